"""`cp-runtime demo`: a served session with a planted fact, end to end, in this process."""

import os
import subprocess
import sys

import numpy as np

from cp_runtime.cli.demo import planted_fact_document
from cp_runtime.cli.main import main
from cp_runtime.model.recall import RecallLayout


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


# What a plain `pip install .` lacks: the extras' packages, made unimportable in a subprocess.
WITHOUT_EXTRAS = ("ray", "yaml", "matplotlib", "tokenizers", "hypothesis")


def run_without_extras(*argv: str, env=None) -> subprocess.CompletedProcess:
    """`cp-runtime ARGV` in a fresh interpreter in which no extra's package can be imported."""
    code = ("import sys\n"
            f"for name in {WITHOUT_EXTRAS!r}:\n"
            "    sys.modules[name] = None\n"
            "from cp_runtime.cli.main import main\n"
            f"sys.exit(main({list(argv)!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=600)


def test_a_plain_install_plans_and_names_the_extra_it_lacks():
    out = run_without_extras("capacity", "--model", "glm-5.2")
    assert out.returncode == 0 and "tokens that fit" in out.stdout, out.stderr
    out = run_without_extras("serve", "--executor", "ray", "--port", "0")
    assert out.returncode == 2
    assert "--executor ray needs ray" in out.stderr and "cp-runtime[ray]" in out.stderr
    out = run_without_extras("bench", "capacity")
    assert out.returncode == 2 and "cp-runtime[bench]" in out.stderr, out.stderr


def test_the_demo_starts_no_libtpu_on_a_machine_without_a_tpu():
    """With the tpu extra installed, libtpu would look for a TPU at JAX's first backend use and
    print a page of warnings (TPU_ACCELERATOR_TYPE, worker hostnames); the command line keeps
    JAX on the CPU where no TPU chip is attached (cp_runtime.platform). The demo runs without
    any extra's package, as from a plain install."""
    from cp_runtime.platform import tpu_chips_present

    if tpu_chips_present():
        import pytest
        pytest.skip("this machine has TPU chips")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "CP_RUNTIME_TOKEN")}
    out = run_without_extras("demo", "--tokens", "4k", "--no-progress", env=env)
    assert out.returncode == 0, out.stderr
    printed = out.stdout + out.stderr
    for noise in ("libtpu", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "InitGoogle",
                  "Unable to initialize backend"):
        assert noise not in printed, (noise, printed[-2000:])
    assert "(right;" in out.stdout
