"""`cp-runtime demo`: a served session with a planted fact, end to end, in this process."""

import numpy as np

from cp_runtime.cli import main
from cp_runtime.demo import planted_fact_document
from cp_runtime.recall_model import RecallLayout


def test_the_demo_answers_its_planted_fact(capsys):
    assert main(["demo", "--tokens", "4k", "--depth", "0.25", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "(right;" in out and "time to first token" in out and "pages per shard" in out


def test_the_document_plants_one_fact_and_ends_with_its_question():
    layout = RecallLayout()
    doc = planted_fact_document(layout, 1000, 0.5, np.random.default_rng(0))
    facts = [t for t in doc.tokens.tolist() if layout.hub < t < layout.query(0)]
    assert len(doc.tokens) == 1000 and doc.fact_position == 499 and len(facts) == 1
    assert doc.tokens[-1] >= layout.query(0) and doc.answer in layout.answer_ids


def test_bad_demo_flags_are_usage_errors(capsys):
    assert main(["demo", "--depth", "2"]) == 2
    assert "--depth" in capsys.readouterr().err
