"""Tool use: given 1-5 tool schemas and a request, call the right one with the right
arguments, or answer directly when none fits; given a tool result, answer from it.

The model must read the schemas, not remember a handful of tools, so every schema is drawn
from a generated variety: per family several function names, descriptions and argument-name
synonyms, an optional random namespace word, snake_case or camelCase. Evaluation uses
namespace words, one function-name variant and one argument-name variant per family that
training never shows (`split="eval"`), so a model that memorised names fails the probe.
"""
from __future__ import annotations

import json
import random
import re
import string
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from moet.probe.chat_format import Conversation
from moet.probe.facts import CAPITALS
from moet.probe.needle import ADJECTIVES, NOUNS

Rng = random.Random

# --- value pools ---------------------------------------------------------------------------------
CITIES = [a.split(",")[0] for _, a in CAPITALS] + [
    "Lyon", "Osaka", "Chicago", "Toronto", "Munich", "Barcelona", "Milan", "Seattle", "Boston",
    "Sydney", "Melbourne", "Hamburg", "Porto", "Krakow", "Denver", "Austin", "Geneva", "Zurich"]
PEOPLE = ("alice bob carol dave erin frank grace heidi ivan judy kim liam maya nina oscar "
          "peggy quinn rosa sam tara uma victor wendy xena yusuf zoe").split()
DOMAINS = ["example.com", "mail.org", "corp.net", "acme.io", "school.edu", "shop.co"]
TOPICS = ("budget meeting launch invoice report party trip dinner review interview design "
          "roadmap release contract workshop lunch demo offsite").split()
LANGUAGES = ["French", "Spanish", "German", "Italian", "Japanese", "Portuguese", "Dutch", "Swedish",
             "Polish", "Turkish", "Korean", "Chinese", "Greek", "Finnish"]
PHRASES = ["good morning", "where is the station", "thank you very much", "see you tomorrow",
           "I love this city", "how much does it cost", "the weather is nice", "happy birthday",
           "where is the library", "I would like a coffee", "good night", "nice to meet you"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "CNY", "INR", "BRL", "SEK", "NOK"]
UNIT_PAIRS = [("km", "miles"), ("miles", "km"), ("kg", "pounds"), ("pounds", "kg"), ("liters", "gallons"),
              ("meters", "feet"), ("feet", "meters"), ("celsius", "fahrenheit")]
NEWS = ["sports", "technology", "science", "politics", "business", "health", "music", "travel", "space"]
FOODS = ["pizza", "sushi", "tacos", "burgers", "salad", "noodles", "sandwiches", "dumplings", "curry"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]
FILE_PATTERNS = ["*.py", "*.txt", "*.csv", "report_*.pdf", "*.json", "notes*.md", "*.log"]
FOLDERS = ["/home/user/docs", "src", "data", "/var/log", "~/projects", "downloads", "/tmp/work"]
TABLES = ["users", "orders", "products", "events", "payments", "sessions"]
COLUMNS = ["name", "email", "total", "created_at", "status", "price"]


def _word(rng: Rng, syllables: int) -> str:
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(syllables))


def _title(rng: Rng) -> str:
    return f"{rng.choice(ADJECTIVES)} {rng.choice(TOPICS)}"


def _email(rng: Rng) -> str:
    return f"{rng.choice(PEOPLE)}@{rng.choice(DOMAINS)}"


def _date(rng: Rng) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _clock(rng: Rng) -> str:
    return f"{rng.randint(6, 22):02d}:{rng.choice(['00', '15', '30', '45'])}"


def _ticker(rng: Rng) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(3, 4)))


def _song(rng: Rng) -> str:
    return f"{rng.choice(ADJECTIVES).title()} {rng.choice(NOUNS).title()}"


def _num(lo: int, hi: int) -> Callable[[Rng], str]:
    return lambda rng: str(rng.randint(lo, hi))


# --- families -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arg:
    slot: str                     # the placeholder used in requests / answers
    names: tuple[str, ...]        # argument-name synonyms; the last is eval-only when >= 3
    desc: str
    value: Callable[[Rng], str]
    required: bool = True
    type: str = "string"


@dataclass(frozen=True)
class Family:
    key: str
    names: tuple[str, ...]        # function-name variants (snake_case words); the last is eval-only
    descs: tuple[str, ...]
    args: tuple[Arg, ...]
    requests: tuple[str, ...]     # "[...]" segments appear only when their optional slots are set
    result: Callable[[Rng, dict[str, str]], dict[str, Any]]
    answer: str                   # formatted with slots + result fields
    cannot: str                   # "I can't {cannot} with the tools I have."


def _r(**fields: Callable[[Rng, dict[str, str]], Any]) -> Callable[[Rng, dict[str, str]], dict[str, Any]]:
    return lambda rng, v: {k: f(rng, v) for k, f in fields.items()}


FAMILIES: tuple[Family, ...] = (
    Family("weather", ("get_weather", "weather_lookup", "fetch_forecast", "current_weather"),
           ("Get the current weather for a city.", "Look up today's weather in a location."),
           (Arg("city", ("city", "location", "place"), "Name of the city", lambda r: r.choice(CITIES)),
            Arg("unit", ("unit", "units", "temp_unit"), "celsius or fahrenheit",
                lambda r: r.choice(["celsius", "fahrenheit"]), required=False)),
           ("What's the weather in {city}[ in {unit}]?", "How is the weather in {city} today[, in {unit}]?",
            "Is it cold in {city} right now?[ Use {unit}.]", "Weather for {city}[ in {unit}], please."),
           _r(temperature=lambda r, v: r.randint(-10, 35), condition=lambda r, v: r.choice(CONDITIONS)),
           "It is {temperature} degrees and {condition} in {city}.", "check the weather"),
    Family("stock", ("get_stock_price", "stock_quote", "lookup_ticker", "share_price"),
           ("Get the latest price of a stock.", "Return the current quote for a ticker symbol."),
           (Arg("symbol", ("symbol", "ticker", "stock_symbol"), "Ticker symbol", _ticker),),
           ("What is {symbol} trading at?", "Get me the stock price of {symbol}.", "How much is one share of {symbol}?"),
           _r(price=lambda r, v: round(r.uniform(5, 900), 2), currency=lambda r, v: "USD"),
           "{symbol} is trading at {price} {currency}.", "look up stock prices"),
    Family("translate", ("translate_text", "translate", "do_translation", "language_translate"),
           ("Translate text into another language.", "Translate a phrase to a target language."),
           (Arg("text", ("text", "phrase", "source_text"), "Text to translate", lambda r: r.choice(PHRASES)),
            Arg("language", ("target_language", "language", "to_lang"), "Target language",
                lambda r: r.choice(LANGUAGES))),
           ("Translate \"{text}\" into {language}.", "How do you say \"{text}\" in {language}?",
            "Please translate \"{text}\" to {language}."),
           _r(translation=lambda r, v: " ".join(_word(r, r.randint(1, 3)) for _ in range(len(v["text"].split())))),
           "In {language}, \"{text}\" is \"{translation}\".", "translate text"),
    Family("email", ("send_email", "email_send", "compose_mail", "mail_message"),
           ("Send an email message.", "Send an email to a recipient with a subject."),
           (Arg("to", ("to", "recipient", "email_address"), "Recipient email address", _email),
            Arg("subject", ("subject", "title", "topic"), "Subject line", _title)),
           ("Send an email to {to} with the subject \"{subject}\".", "Email {to} about \"{subject}\".",
            "Please mail {to}, subject: {subject}."),
           _r(status=lambda r, v: "sent", message_id=lambda r, v: f"msg_{r.randint(1000, 9999)}"),
           "Your email to {to} has been sent (id {message_id}).", "send emails"),
    Family("timer", ("set_timer", "start_timer", "create_countdown", "timer_start"),
           ("Start a countdown timer.", "Set a timer for a number of minutes."),
           (Arg("minutes", ("minutes", "duration_minutes", "mins"), "Length in minutes", _num(1, 90), type="integer"),),
           ("Set a timer for {minutes} minutes.", "Start a {minutes} minute countdown.",
            "Remind me in {minutes} minutes with a timer."),
           _r(timer_id=lambda r, v: f"t{r.randint(10, 99)}", status=lambda r, v: "running"),
           "Your {minutes} minute timer is running.", "set timers"),
    Family("calendar", ("create_event", "add_calendar_event", "schedule_meeting", "calendar_add"),
           ("Add an event to the calendar.", "Create a calendar entry on a date."),
           (Arg("title", ("title", "event_name", "summary"), "Event title", _title),
            Arg("date", ("date", "day", "event_date"), "Date as YYYY-MM-DD", _date),
            Arg("time", ("time", "start_time", "at"), "Start time HH:MM", _clock, required=False)),
           ("Add \"{title}\" to my calendar on {date}[ at {time}].", "Schedule {title} for {date}[ at {time}].",
            "Put an event called \"{title}\" on {date}[, starting {time}]."),
           _r(event_id=lambda r, v: f"evt_{r.randint(100, 999)}"),
           "I added \"{title}\" on {date} to your calendar.", "manage your calendar"),
    Family("search", ("web_search", "search_web", "internet_search", "query_search_engine"),
           ("Search the web.", "Run a web search and return the top results."),
           (Arg("query", ("query", "q", "search_terms"), "Search query",
                lambda r: f"{r.choice(ADJECTIVES)} {r.choice(NOUNS)} {r.choice(['facts', 'pictures', 'history', 'recipes', 'news'])}"),),
           ("Search the web for {query}.", "Look up {query} online.", "Can you find {query} on the internet?"),
           _r(top_result=lambda r, v: f"https://www.{_word(r, 2)}.com/{_word(r, 2)}"),
           "The top result for {query} is {top_result}.", "search the web"),
    Family("currency", ("convert_currency", "currency_exchange", "fx_convert", "exchange_money"),
           ("Convert an amount between currencies.", "Convert money from one currency to another."),
           (Arg("amount", ("amount", "value", "sum"), "Amount to convert", _num(1, 5000), type="number"),
            Arg("from", ("from_currency", "source_currency", "base"), "Currency code to convert from",
                lambda r: r.choice(CURRENCIES)),
            Arg("to", ("to_currency", "target_currency", "quote"), "Currency code to convert to",
                lambda r: r.choice(CURRENCIES))),
           ("Convert {amount} {from} to {to}.", "How much is {amount} {from} in {to}?",
            "What do I get for {amount} {from} in {to}?"),
           _r(converted=lambda r, v: round(float(v["amount"]) * r.uniform(0.2, 3), 2)),
           "{amount} {from} is {converted} {to}.", "convert currencies"),
    Family("time", ("get_local_time", "current_time", "time_in_city", "clock_lookup"),
           ("Get the local time in a city.", "Return the current time for a location."),
           (Arg("city", ("city", "location", "place"), "City name", lambda r: r.choice(CITIES)),),
           ("What time is it in {city}?", "Tell me the local time in {city}.", "Current time in {city}?"),
           _r(time=lambda r, v: _clock(r)), "It is {time} in {city}.", "tell the time"),
    Family("distance", ("get_distance", "distance_between", "route_length", "measure_distance"),
           ("Distance between two cities.", "Compute the travel distance between two places."),
           (Arg("origin", ("origin", "from_city", "start"), "Starting city", lambda r: r.choice(CITIES)),
            Arg("destination", ("destination", "to_city", "end"), "Destination city", lambda r: r.choice(CITIES))),
           ("How far is it from {origin} to {destination}?", "Distance from {origin} to {destination}?",
            "What is the distance between {origin} and {destination}?"),
           _r(distance_km=lambda r, v: r.randint(20, 15000)),
           "The distance from {origin} to {destination} is {distance_km} km.", "measure distances"),
    Family("restaurant", ("book_table", "reserve_restaurant", "make_reservation", "restaurant_booking"),
           ("Book a table at a restaurant.", "Reserve a restaurant table for a group."),
           (Arg("restaurant", ("restaurant", "venue", "place_name"), "Restaurant name",
                lambda r: f"The {r.choice(ADJECTIVES).title()} {r.choice(NOUNS).title()}"),
            Arg("people", ("party_size", "guests", "people"), "Number of people", _num(1, 12), type="integer"),
            Arg("date", ("date", "day", "on_date"), "Date as YYYY-MM-DD", _date)),
           ("Book a table for {people} at {restaurant} on {date}.",
            "Reserve {restaurant} for {people} people on {date}.",
            "Can you get us a table at {restaurant} on {date}? We are {people}."),
           _r(confirmation=lambda r, v: f"R-{r.randint(1000, 9999)}"),
           "Your table for {people} at {restaurant} on {date} is booked (confirmation {confirmation}).",
           "book restaurants"),
    Family("flights", ("find_flights", "search_flights", "flight_lookup", "get_airfare"),
           ("Search for flights between two cities.", "Find available flights on a date."),
           (Arg("origin", ("origin", "from_city", "departure"), "Departure city", lambda r: r.choice(CITIES)),
            Arg("destination", ("destination", "to_city", "arrival"), "Arrival city", lambda r: r.choice(CITIES)),
            Arg("date", ("date", "departure_date", "when"), "Date as YYYY-MM-DD", _date)),
           ("Find flights from {origin} to {destination} on {date}.",
            "Are there flights from {origin} to {destination} on {date}?",
            "I need to fly from {origin} to {destination} on {date}."),
           _r(flights=lambda r, v: r.randint(1, 9), cheapest=lambda r, v: r.randint(80, 1500)),
           "I found {flights} flights from {origin} to {destination}; the cheapest costs {cheapest} USD.",
           "search flights"),
    Family("music", ("play_song", "play_music", "start_playback", "music_play"),
           ("Play a song.", "Start playing a track by title."),
           (Arg("song", ("song", "title", "track"), "Song title", _song),
            Arg("artist", ("artist", "band", "performer"), "Artist name",
                lambda r: f"The {r.choice(NOUNS).title()}s", required=False)),
           ("Play {song}[ by {artist}].", "I want to hear {song}[ by {artist}].", "Put on {song}[ from {artist}], please."),
           _r(status=lambda r, v: "playing"), "Now playing {song}.", "play music"),
    Family("define", ("define_word", "dictionary_lookup", "get_definition", "word_meaning"),
           ("Look up the definition of a word.", "Return the dictionary meaning of a word."),
           (Arg("word", ("word", "term", "entry"), "The word", lambda r: r.choice(NOUNS)),),
           ("Define the word {word}.", "What does {word} mean?", "Look up {word} in the dictionary."),
           _r(definition=lambda r, v: f"a {r.choice(ADJECTIVES)} kind of {r.choice(NOUNS)}"),
           "{word}: {definition}.", "look up definitions"),
    Family("note", ("create_note", "save_note", "add_note", "note_create"),
           ("Save a note.", "Create a new note with a title."),
           (Arg("title", ("title", "name", "heading"), "Note title", _title),),
           ("Save a note called \"{title}\".", "Create a note titled {title}.", "Make a new note: {title}."),
           _r(note_id=lambda r, v: f"n{r.randint(100, 999)}"), "I saved the note \"{title}\".", "take notes"),
    Family("files", ("search_files", "find_files", "list_matching_files", "file_glob"),
           ("Find files matching a pattern.", "Search a folder for files by pattern."),
           (Arg("pattern", ("pattern", "glob", "name_pattern"), "Filename pattern", lambda r: r.choice(FILE_PATTERNS)),
            Arg("folder", ("folder", "directory", "path"), "Folder to search", lambda r: r.choice(FOLDERS))),
           ("Find {pattern} files in {folder}.", "Which files match {pattern} in {folder}?",
            "Search {folder} for {pattern}."),
           _r(matches=lambda r, v: r.randint(0, 40)), "I found {matches} files matching {pattern} in {folder}.",
           "search files"),
    Family("sql", ("run_sql", "query_database", "execute_query", "db_select"),
           ("Run a SQL query.", "Execute a read-only SQL statement against the database."),
           (Arg("query", ("query", "sql", "statement"), "SQL query",
                lambda r: f"SELECT {r.choice(COLUMNS)} FROM {r.choice(TABLES)} WHERE id = {r.randint(1, 999)}"),),
           ("Run this query: {query}", "Execute {query} on the database.", "Query the database: {query}"),
           _r(rows=lambda r, v: r.randint(0, 50)), "The query returned {rows} rows.", "query databases"),
    Family("package", ("track_package", "parcel_status", "shipment_tracking", "where_is_my_package"),
           ("Track a parcel by tracking number.", "Get the delivery status of a shipment."),
           (Arg("tracking", ("tracking_number", "tracking_id", "parcel_id"), "Tracking number",
                lambda r: f"1Z{r.randint(10000000, 99999999)}"),),
           ("Where is my package {tracking}?", "Track parcel {tracking}.", "What's the status of shipment {tracking}?"),
           _r(status=lambda r, v: r.choice(["in transit", "out for delivery", "delivered"]), eta=lambda r, v: _date(r)),
           "Package {tracking} is {status} (expected {eta}).", "track packages"),
    Family("news", ("get_news", "latest_headlines", "news_feed", "top_stories"),
           ("Get the latest news headlines on a topic.", "Fetch top news for a topic."),
           (Arg("topic", ("topic", "category", "section"), "News topic", lambda r: r.choice(NEWS)),),
           ("What's the latest {topic} news?", "Give me today's {topic} headlines.", "Any news about {topic}?"),
           _r(headline=lambda r, v: f"{r.choice(ADJECTIVES).title()} {r.choice(NOUNS)} surprises experts"),
           "Top {topic} headline: {headline}.", "read the news"),
    Family("reminder", ("set_reminder", "create_reminder", "remind_me", "reminder_add"),
           ("Create a reminder.", "Remind the user about something at a time."),
           (Arg("task", ("task", "text", "what"), "What to be reminded of",
                lambda r: r.choice(["call mom", "water the plants", "pay rent", "buy milk", "stretch",
                                    "send the report", "book a dentist", "walk the dog"])),
            Arg("time", ("time", "at", "when_time"), "Time HH:MM", _clock)),
           ("Remind me to {task} at {time}.", "Set a reminder to {task} at {time}.", "At {time}, remind me to {task}."),
           _r(reminder_id=lambda r, v: f"rem{r.randint(10, 999)}"), "I will remind you to {task} at {time}.",
           "set reminders"),
    Family("calculator", ("calculate", "evaluate_expression", "math_eval", "compute"),
           ("Evaluate an arithmetic expression.", "Calculate the value of a math expression."),
           (Arg("expression", ("expression", "expr", "formula"), "Expression to evaluate",
                lambda r: f"{r.randint(2, 99)} {r.choice('*+-')} {r.randint(2, 99)}"),),
           ("Use the calculator for {expression}.", "Evaluate {expression} with the tool.",
            "Calculate {expression} for me using the calculator."),
           _r(result=lambda r, v: eval(v["expression"])),  # noqa: S307 - digits and one operator only
           "{expression} = {result}.", "use a calculator"),
    Family("population", ("get_population", "population_lookup", "country_population", "census_count"),
           ("Get the population of a country.", "Look up how many people live in a country."),
           (Arg("country", ("country", "nation", "country_name"), "Country name",
                lambda r: r.choice(CAPITALS)[0].removeprefix("the ")),),
           ("What is the population of {country}?", "How many people live in {country}?",
            "Look up the population of {country}."),
           _r(population=lambda r, v: r.randint(10_000, 1_400_000_000)),
           "{country} has a population of {population}.", "look up populations"),
    Family("units", ("convert_units", "unit_conversion", "measure_convert", "units_convert"),
           ("Convert a quantity between units.", "Convert a value from one unit to another."),
           (Arg("value", ("value", "quantity", "amount"), "Number to convert", _num(1, 500), type="number"),
            Arg("from", ("from_unit", "source_unit", "unit_in"), "Unit to convert from", lambda r: "km"),
            Arg("to", ("to_unit", "target_unit", "unit_out"), "Unit to convert to", lambda r: "miles")),
           ("Convert {value} {from} to {to}.", "How many {to} is {value} {from}?", "What is {value} {from} in {to}?"),
           _r(result=lambda r, v: round(float(v["value"]) * r.uniform(0.3, 3), 2)),
           "{value} {from} is {result} {to}.", "convert units"),
    Family("food", ("order_food", "place_order", "food_delivery", "order_meal"),
           ("Order food for delivery.", "Place a food delivery order."),
           (Arg("item", ("item", "dish", "food"), "What to order", lambda r: r.choice(FOODS)),
            Arg("quantity", ("quantity", "count", "portions"), "How many", _num(1, 6), type="integer")),
           ("Order {quantity} {item} for me.", "I'd like {quantity} portions of {item} delivered.",
            "Get me {quantity} {item}, please."),
           _r(order_id=lambda r, v: f"ord{r.randint(1000, 9999)}", eta_minutes=lambda r, v: r.randint(15, 60)),
           "I ordered {quantity} {item}; it arrives in {eta_minutes} minutes.", "order food"),
)
_BY_KEY = {f.key: f for f in FAMILIES}


def _is_eval_namespace(word: str) -> bool:
    return zlib.crc32(word.encode()) % 5 == 0


def _namespace(rng: Rng, split: str) -> str:
    while True:
        w = _word(rng, rng.randint(2, 3))
        if _is_eval_namespace(w) == (split == "eval"):
            return w


def _style(words: list[str], camel: bool) -> str:
    return words[0] + "".join(w.title() for w in words[1:]) if camel else "_".join(words)


def _variants(options: tuple[str, ...], split: str) -> tuple[str, ...]:
    if len(options) < 3:
        return options
    return options[-1:] if split == "eval" else options[:-1]


@dataclass
class Tool:
    family: Family
    name: str
    arg_names: dict[str, str]     # slot -> argument name in this schema
    schema: dict[str, Any]


def make_tool(rng: Rng, family: Family, split: str, camel: bool | None = None, namespace_p: float = 0.5) -> Tool:
    camel = rng.random() < 0.3 if camel is None else camel
    words = rng.choice(_variants(family.names, split)).split("_")
    if split == "eval" or rng.random() < namespace_p:
        words = [_namespace(rng, split)] + words
    name = _style(words, camel)
    arg_names = {a.slot: _style(rng.choice(_variants(a.names, split)).split("_"), camel) for a in family.args}
    props = {arg_names[a.slot]: {"type": a.type, "description": a.desc} for a in family.args}
    schema = {"type": "function", "function": {
        "name": name, "description": rng.choice(family.descs),
        "parameters": {"type": "object", "properties": props,
                       "required": [arg_names[a.slot] for a in family.args if a.required]}}}
    return Tool(family, name, arg_names, schema)


_OPT = re.compile(r"\[([^\]]*)\]")


def _request(rng: Rng, family: Family, values: dict[str, str]) -> str:
    def keep(m: re.Match) -> str:
        seg = m.group(1)
        return seg.format(**values) if all(s in values for s in re.findall(r"\{(\w+)\}", seg)) else ""
    t = rng.choice(family.requests)
    return _OPT.sub(keep, t).format(**values)


def _values(rng: Rng, family: Family) -> dict[str, str]:
    v = {a.slot: a.value(rng) for a in family.args if a.required or rng.random() < 0.5}
    if family.key == "units":
        v["from"], v["to"] = rng.choice(UNIT_PAIRS)
    pair = {"currency": ("from", "to"), "distance": ("origin", "destination"),
            "flights": ("origin", "destination")}.get(family.key)
    if pair:  # converting EUR to EUR or flying Paris -> Paris makes no sense
        arg = next(a for a in family.args if a.slot == pair[1])
        while v[pair[0]] == v[pair[1]]:
            v[pair[1]] = arg.value(rng)
    return v


def _direct_question(rng: Rng) -> tuple[Conversation, dict[str, Any]]:
    """A request no tool serves: a capital or an arithmetic question, answered as usual."""
    from moet.probe import arithmetic, facts
    conv = facts.sample(rng) if rng.random() < 0.5 else arithmetic.sample(rng)
    return conv, {"kind": "direct", "contains": str(conv.meta["expected"]).split(",")[0]}


def sample(rng: Rng, split: str = "train", namespace_p: float = 0.5) -> Conversation:
    """One tool-use conversation. Kinds (train mix): call 55%, call+result+answer 25%,
    no tool fits the request (missing family) 10%, plain question with tools present 10%.
    `namespace_p`: share of tool names given a random namespace word (eval: always)."""
    n_tools = rng.randint(1, 5)
    fams = rng.sample(FAMILIES, k=n_tools + 1)
    target, absent = fams[0], fams[-1]
    camel = rng.random() < 0.3
    tools = [make_tool(rng, f, split, camel, namespace_p) for f in fams[:n_tools]]
    rng.shuffle(tools)
    schemas = [t.schema for t in tools]
    system = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
    think = rng.random() < 0.8
    kind = rng.random()
    if kind < 0.10:  # the request is for a family we have no tool for
        values = _values(rng, absent)
        msgs = system + [{"role": "user", "content": _request(rng, absent, values)},
                         {"role": "assistant", "content": f"Sorry, I can't {absent.cannot} with the tools I have."}]
        return Conversation(msgs, schemas, think, {"kind": "none"})
    if kind < 0.20:
        conv, meta = _direct_question(rng)
        return Conversation(system + conv.messages, schemas, conv.enable_thinking, meta)
    tool = next(t for t in tools if t.family is target)
    values = _values(rng, target)
    args = {tool.arg_names[a.slot]: values[a.slot] for a in target.args if a.slot in values}
    msgs = system + [{"role": "user", "content": _request(rng, target, values)},
                     {"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {"name": tool.name, "arguments": args}}]}]
    meta = {"kind": "call", "name": tool.name, "arguments": args}
    if kind >= 0.75:
        result = target.result(rng, values)
        msgs += [{"role": "tool", "content": json.dumps(result)},
                 {"role": "assistant", "content": target.answer.format(**values, **result)}]
    return Conversation(msgs, schemas, think, meta)


def eval_cases(n: int = 120, seed: int = 4321) -> list[Conversation]:
    """Prompts (no final assistant turn) with held-out names: 60% must call a tool, 20% must
    answer from a tool result, 20% must decline (no tool fits)."""
    rng, cases = random.Random(seed), []
    for i in range(n):
        n_tools = rng.randint(1, 5)
        fams = rng.sample(FAMILIES, k=n_tools + 1)
        tools = [make_tool(rng, f, "eval") for f in fams[:n_tools]]
        rng.shuffle(tools)
        schemas = [t.schema for t in tools]
        r = i % 5
        if r == 4:
            absent = fams[-1]
            msgs = [{"role": "user", "content": _request(rng, absent, _values(rng, absent))}]
            cases.append(Conversation(msgs, schemas, True, {"kind": "none"}))
            continue
        target = fams[0]
        tool = next(t for t in tools if t.family is target)
        values = _values(rng, target)
        args = {tool.arg_names[a.slot]: values[a.slot] for a in target.args if a.slot in values}
        msgs = [{"role": "user", "content": _request(rng, target, values)}]
        if r == 3:
            result = target.result(rng, values)
            msgs += [{"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {"name": tool.name, "arguments": args}}]},
                     {"role": "tool", "content": json.dumps(result)}]
            # The answer must quote a field of the result (or, if the template quotes none, the request).
            keys = [k for k in result if "{" + k + "}" in target.answer]
            expect = str(result[keys[0]]) if keys else next(values[s] for s in values if "{" + s + "}" in target.answer)
            cases.append(Conversation(msgs, schemas, True, {"kind": "result", "contains": expect}))
        else:
            cases.append(Conversation(msgs, schemas, True, {"kind": "call", "name": tool.name, "arguments": args}))
    return cases


def score(reply, meta: dict[str, Any]) -> dict[str, bool]:
    """reply: chat_format.ParsedReply. -> {"valid", "name", "args", "correct"} for this case."""
    kind = meta["kind"]
    if kind == "call":
        valid = reply.valid and len(reply.tool_calls) == 1
        name_ok = valid and reply.tool_calls[0][0] == meta["name"]
        args_ok = name_ok and reply.tool_calls[0][1] == {k: str(v) for k, v in meta["arguments"].items()}
        return {"valid": valid, "name": name_ok, "args": args_ok, "correct": args_ok}
    no_call = reply.valid and not reply.tool_calls
    if kind == "result":
        return {"valid": no_call, "correct": no_call and meta["contains"] in reply.content}
    if kind == "direct":
        return {"valid": no_call, "correct": no_call and meta["contains"] in reply.content}
    return {"valid": no_call, "correct": no_call}
