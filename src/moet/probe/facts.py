"""Country -> capital facts, asked in several phrasings. Some phrasings are held out of
training, so the probe measures recall of the fact, not of a memorised question string.
Countries with disputed or multiple capitals are left out (the answer must be unambiguous).
"""
from __future__ import annotations

import random

from moet.probe.chat_format import Conversation

# (name as used in a sentence, capital). Names that need an article carry it.
CAPITALS: list[tuple[str, str]] = [
    ("Afghanistan", "Kabul"), ("Albania", "Tirana"), ("Algeria", "Algiers"),
    ("Andorra", "Andorra la Vella"), ("Angola", "Luanda"), ("Antigua and Barbuda", "Saint John's"),
    ("Argentina", "Buenos Aires"), ("Armenia", "Yerevan"), ("Australia", "Canberra"),
    ("Austria", "Vienna"), ("Azerbaijan", "Baku"), ("the Bahamas", "Nassau"), ("Bahrain", "Manama"),
    ("Bangladesh", "Dhaka"), ("Barbados", "Bridgetown"), ("Belarus", "Minsk"), ("Belgium", "Brussels"),
    ("Belize", "Belmopan"), ("Benin", "Porto-Novo"), ("Bhutan", "Thimphu"),
    ("Bosnia and Herzegovina", "Sarajevo"), ("Botswana", "Gaborone"), ("Brazil", "Brasilia"),
    ("Brunei", "Bandar Seri Begawan"), ("Bulgaria", "Sofia"), ("Burkina Faso", "Ouagadougou"),
    ("Cambodia", "Phnom Penh"), ("Cameroon", "Yaounde"), ("Canada", "Ottawa"), ("Cape Verde", "Praia"),
    ("the Central African Republic", "Bangui"), ("Chad", "N'Djamena"), ("Chile", "Santiago"),
    ("China", "Beijing"), ("Colombia", "Bogota"), ("Comoros", "Moroni"),
    ("the Republic of the Congo", "Brazzaville"), ("the Democratic Republic of the Congo", "Kinshasa"),
    ("Costa Rica", "San Jose"), ("Croatia", "Zagreb"), ("Cuba", "Havana"), ("Cyprus", "Nicosia"),
    ("the Czech Republic", "Prague"), ("Denmark", "Copenhagen"), ("Djibouti", "Djibouti"),
    ("Dominica", "Roseau"), ("the Dominican Republic", "Santo Domingo"), ("Ecuador", "Quito"),
    ("Egypt", "Cairo"), ("El Salvador", "San Salvador"), ("Equatorial Guinea", "Malabo"),
    ("Eritrea", "Asmara"), ("Estonia", "Tallinn"), ("Ethiopia", "Addis Ababa"), ("Fiji", "Suva"),
    ("Finland", "Helsinki"), ("France", "Paris"), ("Gabon", "Libreville"), ("the Gambia", "Banjul"),
    ("Georgia", "Tbilisi"), ("Germany", "Berlin"), ("Ghana", "Accra"), ("Greece", "Athens"),
    ("Grenada", "Saint George's"), ("Guatemala", "Guatemala City"), ("Guinea", "Conakry"),
    ("Guinea-Bissau", "Bissau"), ("Guyana", "Georgetown"), ("Haiti", "Port-au-Prince"),
    ("Honduras", "Tegucigalpa"), ("Hungary", "Budapest"), ("Iceland", "Reykjavik"),
    ("India", "New Delhi"), ("Indonesia", "Jakarta"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Ireland", "Dublin"), ("Italy", "Rome"), ("Jamaica", "Kingston"), ("Japan", "Tokyo"),
    ("Jordan", "Amman"), ("Kazakhstan", "Astana"), ("Kenya", "Nairobi"), ("Kiribati", "Tarawa"),
    ("Kuwait", "Kuwait City"), ("Kyrgyzstan", "Bishkek"), ("Laos", "Vientiane"), ("Latvia", "Riga"),
    ("Lebanon", "Beirut"), ("Lesotho", "Maseru"), ("Liberia", "Monrovia"), ("Libya", "Tripoli"),
    ("Liechtenstein", "Vaduz"), ("Lithuania", "Vilnius"), ("Luxembourg", "Luxembourg"),
    ("Madagascar", "Antananarivo"), ("Malawi", "Lilongwe"), ("Malaysia", "Kuala Lumpur"),
    ("the Maldives", "Male"), ("Mali", "Bamako"), ("Malta", "Valletta"),
    ("the Marshall Islands", "Majuro"), ("Mauritania", "Nouakchott"), ("Mauritius", "Port Louis"),
    ("Mexico", "Mexico City"), ("Micronesia", "Palikir"), ("Moldova", "Chisinau"), ("Monaco", "Monaco"),
    ("Mongolia", "Ulaanbaatar"), ("Montenegro", "Podgorica"), ("Morocco", "Rabat"),
    ("Mozambique", "Maputo"), ("Myanmar", "Naypyidaw"), ("Namibia", "Windhoek"), ("Nepal", "Kathmandu"),
    ("the Netherlands", "Amsterdam"), ("New Zealand", "Wellington"), ("Nicaragua", "Managua"),
    ("Niger", "Niamey"), ("Nigeria", "Abuja"), ("North Korea", "Pyongyang"),
    ("North Macedonia", "Skopje"), ("Norway", "Oslo"), ("Oman", "Muscat"), ("Pakistan", "Islamabad"),
    ("Palau", "Ngerulmud"), ("Panama", "Panama City"), ("Papua New Guinea", "Port Moresby"),
    ("Paraguay", "Asuncion"), ("Peru", "Lima"), ("the Philippines", "Manila"), ("Poland", "Warsaw"),
    ("Portugal", "Lisbon"), ("Qatar", "Doha"), ("Romania", "Bucharest"), ("Russia", "Moscow"),
    ("Rwanda", "Kigali"), ("Saint Kitts and Nevis", "Basseterre"), ("Saint Lucia", "Castries"),
    ("Saint Vincent and the Grenadines", "Kingstown"), ("Samoa", "Apia"), ("San Marino", "San Marino"),
    ("Sao Tome and Principe", "Sao Tome"), ("Saudi Arabia", "Riyadh"), ("Senegal", "Dakar"),
    ("Serbia", "Belgrade"), ("Seychelles", "Victoria"), ("Sierra Leone", "Freetown"),
    ("Singapore", "Singapore"), ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"),
    ("the Solomon Islands", "Honiara"), ("Somalia", "Mogadishu"), ("South Korea", "Seoul"),
    ("South Sudan", "Juba"), ("Spain", "Madrid"), ("Sudan", "Khartoum"), ("Suriname", "Paramaribo"),
    ("Sweden", "Stockholm"), ("Switzerland", "Bern"), ("Syria", "Damascus"), ("Tajikistan", "Dushanbe"),
    ("Tanzania", "Dodoma"), ("Thailand", "Bangkok"), ("Timor-Leste", "Dili"), ("Togo", "Lome"),
    ("Tonga", "Nuku'alofa"), ("Trinidad and Tobago", "Port of Spain"), ("Tunisia", "Tunis"),
    ("Turkey", "Ankara"), ("Turkmenistan", "Ashgabat"), ("Tuvalu", "Funafuti"), ("Uganda", "Kampala"),
    ("Ukraine", "Kyiv"), ("the United Arab Emirates", "Abu Dhabi"), ("the United Kingdom", "London"),
    ("the United States", "Washington, D.C."), ("Uruguay", "Montevideo"), ("Uzbekistan", "Tashkent"),
    ("Vanuatu", "Port Vila"), ("Vatican City", "Vatican City"), ("Venezuela", "Caracas"),
    ("Vietnam", "Hanoi"), ("Yemen", "Sanaa"), ("Zambia", "Lusaka"), ("Zimbabwe", "Harare"),
]

TRAIN_PHRASINGS = [
    "What is the capital of {c}?",
    "What's the capital city of {c}?",
    "Name the capital of {c}.",
    "Which city is the capital of {c}?",
    "Tell me the capital of {c}.",
    "The capital of {c} is what?",
    "Do you know the capital of {c}?",
    "capital of {c}?",
    "I need the capital city of {c}.",
    "Which city serves as the capital of {c}?",
    "Where is the seat of government of {c}?",
    "Quick question: what is the capital of {c}?",
]
HELDOUT_PHRASINGS = [
    "What city is the capital of {c}?",
    "Can you tell me what the capital of {c} is?",
    "Please state the capital city of {c}.",
    "Which city is {c}'s capital?",
]
_ANSWERS = [
    "The capital of {c} is {a}.",
    "{A} is the capital of {c}.",
    "The capital city of {c} is {a}.",
]
_REVERSE = ["{A} is the capital of which country?", "Which country has {a} as its capital?"]


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _fill(template: str, country: str, capital: str) -> str:
    text = template.format(c=country, a=capital, A=_cap(capital))
    return _cap(text) if template.startswith("{") else text


def sample(rng: random.Random) -> Conversation:
    """A training example: a train phrasing (or the reverse question), one of three answer forms."""
    country, capital = rng.choice(CAPITALS)
    if rng.random() < 0.12:
        q = _fill(rng.choice(_REVERSE), country, capital)
        a = f"{_cap(capital)} is the capital of {country}."
    else:
        q = _fill(rng.choice(TRAIN_PHRASINGS), country, capital)
        a = _fill(rng.choice(_ANSWERS), country, capital)
    return Conversation([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                        enable_thinking=rng.random() < 0.8, meta={"expected": capital, "country": country})


def prose(rng: random.Random) -> str:
    """Facts as plain sentences for the text part of the corpus."""
    picks = rng.sample(CAPITALS, k=rng.randint(3, 8))
    return " ".join(_fill(rng.choice(_ANSWERS), c, a) for c, a in picks) + "\n"


def eval_cases(limit: int | None = None) -> list[Conversation]:
    """Every country in every held-out phrasing (deterministic order), prompt only."""
    cases = [Conversation([{"role": "user", "content": _fill(p, c, a)}], meta={"expected": a, "country": c})
             for p in HELDOUT_PHRASINGS for c, a in CAPITALS]
    if limit is not None and limit < len(cases):
        step = len(cases) / limit
        cases = [cases[int(i * step)] for i in range(limit)]
    return cases


def is_correct(answer_text: str, expected: str, country: str) -> bool:
    """The exact capital (case-sensitive) appears in the answer other than as the echoed country
    name: "Luxembourg is the capital of Luxembourg." passes (two mentions), "The capital of Sao
    Tome and Principe is Paris." fails although it contains "Sao Tome". "Washington, D.C." passes
    on "Washington"."""
    capital = expected.split(",")[0]
    n_cap = answer_text.count(capital)
    if capital == country:
        return n_cap >= 2
    if capital in country:
        return n_cap > answer_text.count(country) * country.count(capital)
    return n_cap > 0
