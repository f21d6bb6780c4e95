"""marscli.scoring.gsm8k: answer extraction and normalisation on hand-written answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marscli.scoring import gsm8k
from marscli.scoring.rouge import reference_text

#: GSM8K records shipped with the repository (examples/README.md: source and licence).
PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "gsm8k.jsonl"


@pytest.mark.parametrize(("answer", "expected"), [
    ("Janet sells 9 eggs at $2 each.\n#### 18", "18"),
    ("#### $1,080.00", "1080"),
    ("####18", "18"),
    ("#### -3", "-3"),
    ("#### 0.50", "0.5"),
    ("#### 18.0", "18"),
    ("#### 1,234,567", "1234567"),
    ("#### 50%", "50"),
    ("#### 18.", "18"),
    ("first guess #### 4, corrected: #### 5", "5"),  # the last marked answer
    ("#### <final_answer>\nSo she makes 18 dollars.", "18"),  # a placeholder: the last number
    ("She makes 9 * 2 = $18 every day.", "18"),  # no ####: the last number
    ("The total is $1,080.", "1080"),
    ("It costs $ 12.50 in total", "12.5"),
    ("The answer is \\boxed{42}.", "42"),
    ("Numbers 1,2,3 are listed", "3"),  # not a thousands comma: three numbers
    ("There were 10,000 people", "10000"),
    ("A temperature of -0 degrees", "0"),
    ("It is .5 of the cake", "0.5"),
    ("16 - 3 - 4 = 9", "9"),
])
def test_extract_answer(answer, expected):
    assert gsm8k.extract_answer(answer) == expected


@pytest.mark.parametrize("answer", ["", None, "I do not know.", "#### none", "The answer is x."])
def test_answers_with_no_number(answer):
    assert gsm8k.extract_answer(answer) is None
    if answer is not None:
        assert gsm8k.score(answer, "#### 3") == (0.0, {"answer": None, "reference_answer": "3"})


def test_score_compares_normalised_numbers():
    assert gsm8k.score("so the answer is 1,080.00", "x = 1080\n#### 1080")[0] == 1.0
    assert gsm8k.score("#### 1081", "#### 1080")[0] == 0.0
    with pytest.raises(ValueError, match="no number"):
        gsm8k.score("#### 3", "no reference")


def test_every_reference_of_the_prompt_set_has_an_answer():
    recs = [json.loads(line) for line in PROMPTS.open()]
    answers = [gsm8k.extract_answer(reference_text(r)) for r in recs]
    assert all(a is not None for a in answers)
    assert answers[0] == "18"  # Janet's ducks
