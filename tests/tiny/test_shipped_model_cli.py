"""The README's main command: `moet generate --chat` on the shipped moet-tiny, and LLM.chat."""
import subprocess
import sys

import pytest

from moet.assets import MOET_TINY


@pytest.fixture(scope="module")
def llm():
    from moet import LLM
    return LLM(str(MOET_TINY), expert_format="fp4", device="cpu")


def test_chat_renders_the_template_and_answers_a_held_out_fact(llm):
    from moet import SamplingParams
    out = llm.chat([{"role": "user", "content": "Which city is the capital of Poland?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    assert "Warsaw" in out[0].outputs[0].text
    # the rendered prompt is the chat template's, ending with the assistant turn
    assert out[0].prompt.rstrip().endswith(llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False).rstrip()[-12:])
    # several conversations at once keep their order
    two = llm.chat([[{"role": "user", "content": "What is the capital of France?"}],
                    [{"role": "user", "content": "What is the capital of Japan?"}]], SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in two[0].outputs[0].text and "Tokyo" in two[1].outputs[0].text


def test_readme_main_command_runs_on_the_shipped_model_by_default():
    r = subprocess.run([sys.executable, "-m", "moet.cli", "generate", "--chat", "--prompt", "What is the capital of Italy?",
                        "--max-tokens", "24", "--expert-format", "fp4", "--device", "cpu"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Rome" in r.stdout and "What is the capital of Italy?" in r.stdout
