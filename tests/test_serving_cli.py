"""``python -m serving``: every flag explained by ``--help`` with its default, a tiny ``generate``
with progress and a summary, bad values refused under the flags' own names."""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import types

import pytest

from serving.__main__ import (
    MAX_SPECULATIVE,
    PROGRESS_FRACTION,
    PROGRESS_INTERVAL_S,
    GenerationProgress,
    build_parser,
    main,
)
from serving.paged_demo import device_description

GENERATE_FLAGS = (
    "--model",
    "--prompt",
    "--max-tokens",
    "--temperature",
    "--top-p",
    "--top-k",
    "--min-p",
    "--seed",
    "--parallel",
    "--speculative",
    "--max-batched-tokens",
    "--prefill-chunk-size",
    "--prefill-grant-interval",
    "--no-overlap",
    "--steps-per-program",
    "--backend",
    "--cascade",
    "--sparse",
    "--sparse-budget",
    "--stats",
)

# Programs that run long (whole generations through the command line): compiled with XLA's CPU
# optimizations (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    # argparse keeps its actions in ``_actions``; the subcommands are one of them.
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices


def test_help_lists_the_subcommands_and_explains_every_generate_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("generate", "demo", "paged-demo"))
    assert "numbered from 1" in text
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert all(flag in text for flag in GENERATE_FLAGS)
    for name, subparser in _subparsers().items():
        for action in subparser._actions:
            assert action.help, f"{name} {action.option_strings} has no help"


def test_help_shows_the_default_of_every_flag_that_has_one():
    """Every option taking a value says its default in ``--help`` (the value itself, or what
    leaving the flag out means)."""
    for name, subparser in _subparsers().items():
        text = subparser.format_help()
        for action in subparser._actions:
            if not action.option_strings or action.nargs == 0 or action.required:
                continue  # --help, --stats (a switch) and --prompt (required) have none
            shown = "all" if action.default is None else str(action.default)
            help_text = action.help % {"default": action.default}
            assert f"(default: {shown})" in help_text, (name, action.option_strings)
            assert f"(default: {shown})" in re.sub(r"\s+", " ", text), (name, action.dest)


@pytest.fixture(scope="module")
def generated():
    """One tiny ``generate`` run with speculation on the reference backend: (status, stdout,
    stderr)."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["generate", "--prompt", "def main(", "--prompt", "import os", "--max-tokens", "6"]
    argv += ["--temperature", "0", "--parallel", "2", "--speculative", "2"]
    argv += ["--backend", "reference", "--stats"]
    original = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        status = main(argv)
    finally:
        sys.stdout, sys.stderr = original
    return status, out.getvalue(), err.getvalue()


def test_generate_prints_the_continuations_numbered_from_1(generated):
    status, out, _ = generated
    assert status == 0
    assert "--- prompt 1 ---" in out and "--- prompt 2 ---" in out
    assert "--- prompt 0 ---" not in out and "--- prompt 3 ---" not in out


def test_generate_reports_progress_through_the_run_and_a_summary(generated):
    """Progress lines (stderr) follow the run to its last token, not just its first step, and
    the summary gives tokens, wall time, tokens/s and the time to first token."""
    _, _, err = generated
    progress = re.findall(r"\] (\d+)/12 tokens", err)
    counts = [int(count) for count in progress]
    assert len(counts) >= 2 and counts == sorted(counts) and counts[-1] == 12, err
    assert err.index("generating 12 tokens for 2 prompt(s)") < err.index("/12 tokens")
    summary = re.search(
        r"^12 tokens in [\d.]+ s, \d+ tokens/s \(compiling included\).*; time to first token "
        r"[\d.]+ s \(median over 2 prompts [\d.]+ s\)$",
        err,
        re.MULTILINE,
    )
    assert summary, err
    assert "acceptance alpha" in err  # --stats with --speculative


class _FakeEngine:
    scheduler = types.SimpleNamespace(num_running=1, num_waiting=0)


def _step(emitted: dict) -> types.SimpleNamespace:
    """A ``StepOutput`` as the progress reads it: tokens per request, and their count."""
    stats = types.SimpleNamespace(num_emitted=sum(len(tokens) for tokens in emitted.values()))
    return types.SimpleNamespace(new_token_ids=emitted, stats=stats)


def test_progress_writes_a_line_each_quarter_and_each_interval():
    """A line when the run passes the next quarter of its tokens or after the interval; none
    for a step that emitted nothing; the summary's figures from the steps' times."""
    times = iter([0.0, 3.0, 3.1, 3.2, 3.3, 3.3 + 2 * PROGRESS_INTERVAL_S, 9.0])
    stream = io.StringIO()
    progress = GenerationProgress(
        _FakeEngine(), total_tokens=40, stream=stream, clock=lambda: next(times)
    )
    progress(_step({}))  # t=3.0: a prefill step, nothing emitted
    progress(_step({1: (5,), 2: (6,)}))  # t=3.1: 2 tokens (5%): the interval since t=0 passed
    progress(_step({1: (7,) * 4, 2: (8,) * 4}))  # t=3.2: 10 tokens (25%): a quarter
    progress(_step({1: (7,)}))  # t=3.3: 11 (27%): neither
    progress(_step({1: (7,)}))  # t=5.3: 12 (30%): the interval
    progress(_step({1: (7,) * 14, 2: (8,) * 14}))  # t=9.0: 40: three quarters at once, one line
    lines = stream.getvalue().splitlines()
    assert [re.search(r"\] (\d+)/40", line).group(1) for line in lines] == [
        "2", "10", "12", "40",
    ]  # fmt: skip
    assert "since the first token" not in lines[0]  # one emitting step: no rate yet
    assert lines[1].startswith("[  3.20 s] 10/40 tokens (25%), 80 tokens/s since the first")
    assert progress.summary() == (
        "40 tokens in 9.00 s, 4 tokens/s (compiling included), 6 tokens/s after the first "
        "token; time to first token 3.10 s (median over 2 prompts 3.10 s)"
    )
    assert PROGRESS_FRACTION == 0.25


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt", ""], "--prompt number 1 is empty"),
        (["--prompt", "a", "--prompt", ""], "--prompt number 2 is empty"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be finite and >= 0, got -1.0"),
        (["--temperature", "nan"], "--temperature must be finite and >= 0, got nan"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-k", "0"], "--top-k must be >= 1 (leave it out to keep every byte), got 0"),
        (["--top-k", "300"], "--top-k must be at most the vocabulary size 256"),
        (["--min-p", "2"], "--min-p must be in [0, 1], got 2.0"),
        (["--seed", "-1"], "--seed must be in [0, 2**63 - 1] for 1 request(s), got -1"),
        (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
        (
            ["--num-samples", "4", "--seed", str(2**63 - 3)],
            "--seed must be in [0, 2**63 - 4] for 4 request(s), got 9223372036854775805",
        ),
        (["--parallel", "0"], "--parallel must be >= 1, got 0"),
        (["--speculative", "-1"], f"--speculative must be in [0, {MAX_SPECULATIVE}]"),
        (["--speculative", "16"], "(the target verifies N + 1 tokens a step), got 16"),
        (["--max-batched-tokens", "0"], "--max-batched-tokens must be >= 1, got 0"),
        (
            ["--prefill-chunk-size", "24"],
            "--prefill-chunk-size must be a power of two >= 1, got 24",
        ),
        (["--prefill-chunk-size", "0"], "--prefill-chunk-size must be a power of two >= 1, got 0"),
        (["--prefill-grant-interval", "-1"], "--prefill-grant-interval must be >= 0, got -1"),
        (["--steps-per-program", "3"], "--steps-per-program must be a power of two in [1, 32]"),
        (["--steps-per-program", "0"], "--steps-per-program must be a power of two in [1, 32]"),
        (["--steps-per-program", "64"], "--steps-per-program must be a power of two in [1, 32]"),
    ],
)
def test_generate_refuses_bad_values_under_the_flags_names(flags, message, capsys):
    if "--prompt" not in flags:
        flags = ["--prompt", "a", *flags]
    assert main(["generate", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error, error
    assert not re.search(
        r"\b(top_p|top_k|min_p|max_tokens|num_speculative|max_batched_tokens|"
        r"prefill_chunk_size|prefill_grant_interval)\b",
        error,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["demo", "--seed", "-3"], "--seed must be in [0, 2**63 - 16), got -3"),
        (["paged-demo", "--seed", "-3"], "--seed must be >= 0, got -3"),
    ],
)
def test_demos_refuse_bad_values_under_the_flags_names(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_device_description_does_not_repeat_the_platform():
    """``paged-demo`` and ``demo`` head their output with it: ``cpu``, not ``cpu (cpu)``."""
    import jax

    description = device_description()
    assert description.startswith(jax.default_backend())
    if jax.default_backend() == "cpu":
        assert description == "cpu"


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "serving", "generate", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0 and "--speculative" in result.stdout


def test_no_overlap_and_steps_per_program_change_the_speed_not_the_output(capsys):
    """Greedy plain decoding with the overlapped loop (the default), with ``--no-overlap`` and
    with four steps a program prints the same continuation."""
    argv = ["generate", "--prompt", "def main(", "--max-tokens", "5", "--temperature", "0"]
    argv += ["--backend", "reference", "--parallel", "1"]
    printed = []
    for extra in ([], ["--no-overlap"], ["--steps-per-program", "4"]):
        assert main([*argv, *extra]) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] == printed[2] and printed[0].strip()


def test_the_command_lines_steps_limit_is_the_engines():
    from serving import __main__ as cli
    from serving import engine

    assert cli.MAX_STEPS_PER_PROGRAM == engine.MAX_STEPS_PER_PROGRAM


def test_num_samples_share_the_prompts_pages_and_draw_their_own_tokens(capsys):
    """``--num-samples 3``: three requests of one prompt, headed "prompt 1, sample j", their
    prompt's full pages shared in the cache (the scheduler's count, printed by --stats); greedy
    they print the same continuation, sampled each draws from its own seed."""
    prompt = "def main(argv):\n    parser = argparse.ArgumentParser()\n"  # > 2 pages of 16
    argv = ["generate", "--prompt", prompt, "--max-tokens", "6", "--num-samples", "3"]
    argv += ["--backend", "reference", "--parallel", "3", "--stats"]
    assert main([*argv, "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    blocks = re.split(r"^--- prompt 1, sample (\d) ---$", captured.out, flags=re.MULTILINE)
    assert blocks[1::2] == ["1", "2", "3"], captured.out
    # Six bytes each (greedy, this model continues with indentation): same bytes, same text.
    assert blocks[2] == blocks[4] == blocks[6] and len(blocks[2].strip("\n")) == 6
    assert "for 1 prompt(s) x 3 samples" in captured.err
    shared = re.search(r"prompt pages shared by requests with a common prompt: (\d+)", captured.err)
    # The first request computes the prompt's full pages; the other two share them.
    full_pages = len(prompt.encode()) // 16
    assert shared and int(shared.group(1)) == 2 * full_pages, captured.err
    assert main([*argv, "--temperature", "1", "--seed", "5"]) == 0
    sampled = re.split(r"^--- prompt 1, sample \d ---$", capsys.readouterr().out, flags=re.M)
    assert len({block for block in sampled[1:]}) > 1  # three seeds, not one stream three times
