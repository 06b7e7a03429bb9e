"""`cp-runtime demo`: a served session with a planted fact, end to end, in this process."""

import numpy as np

from cp_runtime.cli import main
from cp_runtime.demo import planted_fact_document
from cp_runtime.recall_model import RecallLayout


def test_the_demo_answers_its_planted_fact(capsys):
    assert main(["demo", "--tokens", "4k", "--depth", "0.25", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "(right;" in out and "time to first token" in out
    assert "pool: " in out and "used pages per shard: [" in out and "start shard" in out
    assert "= 'value " in out                  # the answer as the recall layout reads it


def test_the_document_plants_one_fact_and_ends_with_its_question():
    layout = RecallLayout()
    doc = planted_fact_document(layout, 1000, 0.5, np.random.default_rng(0))
    facts = [t for t in doc.tokens.tolist() if layout.hub < t < layout.query(0)]
    assert len(doc.tokens) == 1000 and doc.fact_position == 499 and len(facts) == 1
    assert doc.tokens[-1] >= layout.query(0) and doc.answer in layout.answer_ids


def test_bad_demo_flags_are_usage_errors(capsys):
    assert main(["demo", "--depth", "2"]) == 2
    assert "--depth" in capsys.readouterr().err
    assert main(["demo", "--tokens", "2m"]) == 2          # refused before any pool is built
    err = capsys.readouterr().err
    assert "--tokens 2m" in err and "up to 1m" in err


def test_the_demo_starts_no_libtpu_on_a_machine_without_a_tpu():
    """With the tpu extra installed, libtpu would look for a TPU at JAX's first backend use and
    print a page of warnings (TPU_ACCELERATOR_TYPE, worker hostnames); the command line keeps
    JAX on the CPU where no TPU chip is attached (cp_runtime.platform)."""
    import os
    import subprocess
    import sys

    from cp_runtime.platform import tpu_chips_present

    if tpu_chips_present():
        import pytest
        pytest.skip("this machine has TPU chips")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "CP_RUNTIME_TOKEN")}
    out = subprocess.run([sys.executable, "-m", "cp_runtime.cli", "demo", "--tokens", "4k",
                          "--no-progress"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    printed = out.stdout + out.stderr
    for noise in ("libtpu", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "InitGoogle",
                  "Unable to initialize backend"):
        assert noise not in printed, (noise, printed[-2000:])
    assert "(right;" in out.stdout
