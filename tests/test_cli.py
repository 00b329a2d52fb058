"""The kvviz command: JSON output contract, streamed output, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEXT

import kvviz

TINY = ["--model", "tiny-random-llama"]


def kvviz_cli(*args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "kvviz.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_json_contract(tmp_path):
    trace_file = tmp_path / "trace.parquet"
    proc = kvviz_cli("generate", *TINY, "--prompt", TEXT, "--no-chat", "--policy", "inertia",
                     "--compression", "0.5", "--max-new-tokens", "12", "--json", "--trace", str(trace_file))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    prompt_len, budget = out["prompt_len"], out["budget"]
    assert budget == prompt_len // 2
    assert len(out["token_ids"]) == 12 and len(out["steps"]) == 11
    kept_before = set(range(prompt_len))
    for k, step in enumerate(out["steps"], start=1):
        assert step["step"] == k
        assert step["token_id"] == out["token_ids"][k - 1]  # step k consumes generated token k
        assert step["kept"] == sorted(step["kept"]) and len(step["kept"]) <= budget
        new = prompt_len + k - 1
        assert set(step["kept"]) == (kept_before | {new}) - set(step["evicted"])
        kept_before = set(step["kept"])
    import kvviz

    assert kvviz.Trace.load(trace_file).token_ids == out["token_ids"]
    assert kvviz.Trace.load(trace_file).compression == 0.5  # how B was set, for `kvviz trace` and the app
    assert (kvviz.Trace.load(trace_file).prompt, kvviz.Trace.load(trace_file).chat) == (TEXT, False)


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]],
                         ids=["greedy", "sampled"])
def test_generate_on_the_static_backend_prints_what_the_engine_prints(capsys, sampling):
    """--backend static decodes on the slot backend (auto takes it on a GPU): the same tokens and keep sets
    at every step as --backend engine on the same device, sampled with a seed too; a model family it cannot run
    is refused by name, and auto runs that one on the engine."""
    from kvviz.cli import main

    common = ["generate", *TINY, "--prompt", TEXT, "--no-chat", "--compression", "0.5", "--max-new-tokens", "16",
              "--json", *sampling]
    out = {}
    for backend in ("engine", "static"):
        assert main([*common, "--policy", "tova", "--backend", backend]) == 0
        out[backend] = json.loads(capsys.readouterr().out)
    assert out["static"]["token_ids"] == out["engine"]["token_ids"]
    assert [s["kept"] for s in out["static"]["steps"]] == [s["kept"] for s in out["engine"]["steps"]]
    snapkv = [*common, "--policy", "snapkv", "--compression", "0.3"]  # a budget over its 32-token window
    for backend in ("engine", "static"):  # prefill-time: cut by the engine's pass, decoded on the slots
        assert main([*snapkv, "--backend", backend]) == 0
        out[backend] = json.loads(capsys.readouterr().out)
    assert out["static"]["token_ids"] == out["engine"]["token_ids"]
    assert [s["kept"] for s in out["static"]["steps"]] == [s["kept"] for s in out["engine"]["steps"]]
    gemma = [arg if arg != "tiny-random-llama" else "tiny-random-gemma" for arg in common]  # a family it lacks
    assert main([*gemma, "--policy", "tova", "--backend", "static"]) == 2
    assert "backend='static' cannot run TOVA: it reproduces llama" in capsys.readouterr().err
    assert main([*gemma, "--policy", "tova"]) == 0  # auto: the engine


def test_no_chat_tokenises_the_prompt_as_is(capsys):
    from kvviz.cli import main

    common = ["generate", *TINY, "--prompt", TEXT, "--policy", "full", "--max-new-tokens", "2", "--json"]
    assert main([*common, "--no-chat"]) == 0
    plain = json.loads(capsys.readouterr().out)
    _, tokenizer = kvviz.load_model("tiny-random-llama")
    assert plain["prompt_len"] == len(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    assert main(common) == 0
    chat = json.loads(capsys.readouterr().out)
    assert chat["prompt_len"] > plain["prompt_len"]  # the template adds role markers
    # the full cache holds no budget: none reported beside a final cache past the default compression's
    assert chat["budget"] is None and chat["final_cache_size"] == chat["prompt_len"] + 1


def test_plain_output_streams_text_and_summary(tiny):
    proc = kvviz_cli("generate", *TINY, "--prompt", TEXT, "--policy", "inertia-lazy", "--budget", "20",
                     "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "budget 20, final cache 20" in proc.stderr and "tok/s" in proc.stderr
    # a budget the run never reaches says so, beside a final cache under it
    unreached = kvviz_cli("generate", *TINY, "--prompt", TEXT, "--budget", "1000", "--max-new-tokens", "2")
    assert "budget 1000 (never reached: nothing evicted), final cache" in unreached.stderr
    model, tokenizer = tiny
    run = kvviz.run(model, tokenizer, TEXT, "inertia-lazy", budget=20, max_new_tokens=8)  # chat template on
    streamed = "".join(event.text for event in run.trace.events)  # each token as it comes, specials included
    # The pipe is read as text, so any "\r" arrives as "\n"; the summary adds the trailing newlines.
    assert proc.stdout.rstrip("\n") == streamed.replace("\r\n", "\n").replace("\r", "\n").rstrip("\n")
    assert len(run.token_ids) == 8 and streamed.strip()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "   "], "prompt is empty"),
        (["--prompt", TEXT, "--compression", "1.0"], "--compression"),
        (["--prompt", TEXT, "--compression", "-0.2"], "--compression"),
        (["--prompt", TEXT, "--alpha", "1.5"], "alpha must be between 0.0 and 1.0"),
        (["--prompt", TEXT, "--refresh", "-1"], "refresh must be between 0 and 64"),
        (["--prompt", TEXT, "--param", "alpha=abc"], "alpha must be a number"),
        (["--prompt", TEXT, "--param", "refresh=1.5"], "refresh must be a whole number"),
        (["--prompt", TEXT, "--param", "layers=99"], "beyond this model"),
        (["--prompt", TEXT, "--policy", "random", "--param", "seed=abc"], "seed must be a number"),
        (["--prompt", TEXT, "--temperature", "nan"], "--temperature"),
        (["--prompt", TEXT, "--device", "foo"], "unknown device"),
        (["--prompt", TEXT, "--budget", "0"], "--budget"),
        (["--prompt", TEXT, "--policy", "nope"], "unknown policy"),
        (["--prompt", TEXT, "--policy", "full", "--alpha", "0.5"], "no parameter"),
        (["--prompt", TEXT * 200, "--max-new-tokens", "10"], "context"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read"),
        (["--prompt", TEXT, "--static", "--policy", "tova"], "InertiaKV with its attention scorer"),
        (["--prompt", TEXT, "--static", "--policy", "tova"], "; got TOVA: use the engine for this policy"),  # names it
        (["--prompt", TEXT, "--compile"], "--compile applies to --static only; add --static or drop --compile"),
        (["--prompt", TEXT, "--static", "--policy", "inertia-vnorm"], "InertiaKV with its attention scorer"),
        (["--prompt", TEXT, "--static", "--temperature", "0.7"], "greedily and keeps no per-step trace: drop "
                                                                  "--temperature, or drop --static"),
        (["--prompt", TEXT, "--static", "--trace", "/nonexistent/t.parquet"], "drop --trace, or drop --static"),
        (["--prompt", TEXT, "--static", "--temperature", "0.7", "--trace", "t.parquet"],
         "drop --temperature and --trace, or"),
        (["--prompt", TEXT, "--static", "--budget", "100000"], "budget must be between 1 and the prompt length"),
        # Flags that would be silently dropped: said, not guessed.
        (["--prompt", TEXT, "--alpha", "0.7", "--param", "alpha=0.5"], "alpha is given twice (--alpha... and --param"),
        (["--prompt", TEXT, "--param", "alpha=0.7", "--param", "alpha=0.5"], "alpha is given twice"),
        (["--prompt", TEXT, "--policy", "random", "--seed", "2"], "--seed shape sampling, and --temperature 0 "
                                                                  "decodes greedily"),
        (["--prompt", TEXT, "--top-p", "0.5"], "(the random policy's own seed is --param seed=N)"),
        (["--prompt", TEXT, "--model", "/nonexistent/model"], "no folder '/nonexistent/model'"),
    ],
)
def test_bad_arguments_fail_with_one_clear_line(args, message, capsys):
    from kvviz.cli import main

    code = main(["generate", *TINY, *args])  # in-process: same code path as the command, without its start-up
    stderr = capsys.readouterr().err
    assert code != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in stderr


def test_a_compression_that_leaves_no_cache_names_the_option_and_the_default(capsys):
    """A short prompt at the default compression 0.9, which nobody typed: the message says which option it is
    and that 0.9 is its default, with the largest value that runs on this prompt."""
    from kvviz.cli import main

    prompt = ["--prompt", "What is the passkey?", "--no-chat"]  # 6 tokens: floor(0.1 * 6) = 0 entries
    assert main(["generate", *TINY, *prompt]) == 2
    assert capsys.readouterr().err == (
        "kvviz: error: the default --compression 0.9 (used when neither --compression nor --budget is given) leaves "
        "no cache for a 6-token prompt; give --compression 0.83 or lower, a --budget in tokens, or a longer prompt\n")
    assert main(["generate", *TINY, *prompt, "--compression", "0.85"]) == 2
    assert capsys.readouterr().err.startswith("kvviz: error: --compression 0.85 leaves no cache for a 6-token "
                                              "prompt; give --compression 0.83 or lower")
    assert main(["generate", *TINY, *prompt, "--compression", "0.83", "--max-new-tokens", "1"]) == 0  # 1 entry
    assert main(["generate", *TINY, "--prompt", "H", "--no-chat", "--compression", "0.5"]) == 2
    assert "leaves no cache for a 1-token prompt; give --compression 0, a --budget" in capsys.readouterr().err
    # A budget too small for the policy's protected entries, set by a compression: the --compression that works
    prompt = ["--prompt", "x" * 56, "--no-chat", "--policy", "snapkv", "--max-new-tokens", "1"]
    size = len(kvviz.engine.encode_prompt(kvviz.load_model(TINY[1])[1], "x" * 56, chat=False))
    works = max(step / 100 for step in range(100) if int((1 - step / 100) * size + 1e-9) > 32)
    assert main(["generate", *TINY, *prompt]) == 2
    assert capsys.readouterr().err == (
        "kvviz: error: the default --compression 0.9 (used when neither --compression nor --budget is given) leaves "
        f"a budget of {int(0.1 * size + 1e-9)} of this {size}-token prompt, not more than SnapKV's observation window "
        f"of 32 tokens: lower --compression to {works:g} or less (or lower window)\n")
    assert main(["generate", *TINY, *prompt, "--compression", str(works)]) == 0
    assert main(["generate", *TINY, *prompt, "--budget", "32"]) == 2
    assert capsys.readouterr().err.endswith("raise the budget above 32 (or lower window)\n")


def test_a_prompt_file_that_is_not_utf8_is_named(tmp_path, capsys):
    from kvviz.cli import main

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert main(["generate", *TINY, "--prompt-file", str(latin1)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "latin1.txt" in err and "not UTF-8" in err and "byte 3" in err


def test_a_probe_step_past_the_context_names_the_step(capsys):
    from kvviz.cli import main

    assert main(["probe", *TINY, "--prompt", TEXT, "--step", "5000", "--policies", "inertia"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--step 5000" in err and "context of 4096" in err


def test_a_probe_future_past_the_context_says_to_lower_the_future(capsys):
    from kvviz.cli import main

    assert main(["probe", *TINY, "--prompt", TEXT, "--future", "5000", "--policies", "inertia"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "lower --future to" in err and "shorter prompt" in err
    assert "--step 0" not in err and "choose --step" not in err


@pytest.mark.parametrize("args, message", [
    (["--policies", ","], "--policies names no policy; give registry names"),  # ran the probe, ranked nothing
    (["--policies", " "], "--policies names no policy"),
    (["--future", "0"], "--future must be >= 1, got 0"),  # named with its value, not "--future and --batch"
    (["--batch", "-2"], "--batch must be >= 1, got -2"),
])
def test_probe_refuses_what_it_cannot_rank_before_the_model_loads(args, message, capsys, monkeypatch):
    from kvviz.cli import main

    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvviz.models.load_model", load_model)
    assert main(["probe", *TINY, "--prompt", TEXT, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_the_model_dtype_is_chosen_on_the_command_line_and_recorded_in_the_trace(tmp_path, capsys):
    import torch

    from kvviz.cli import main

    args = ["--prompt", TEXT, "--no-chat", "--policy", "inertia", "--compression", "0.5", "--max-new-tokens", "10",
            "--json"]
    trace = tmp_path / "bf16.parquet"
    assert main(["generate", *TINY, "--dtype", "bfloat16", *args, "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert kvviz.Trace.load(trace).dtype == "bfloat16"
    assert main(["trace", str(trace)]) == 0
    printed = capsys.readouterr().out
    assert "inertia (alpha=0.8" in printed and "on tiny-random-llama in bfloat16:" in printed
    model, tokenizer = kvviz.load_model("tiny-random-llama", dtype=torch.bfloat16)
    expected = kvviz.run(model, tokenizer, TEXT, "inertia", chat=False, compression=0.5, max_new_tokens=10)
    assert out["token_ids"] == expected.token_ids
    assert [step["kept"] for step in out["steps"]] == [e.kept.tolist() for e in expected.trace.decode_steps]
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal: usage and one error line, exit 2
        main(["generate", *TINY, "--dtype", "float64", *args])
    assert refused.value.code == 2 and "invalid choice: 'float64'" in capsys.readouterr().err


def test_refresh_zero_is_score_free(capsys):
    from kvviz.cli import main

    common = ["generate", *TINY, "--prompt", TEXT, "--no-chat", "--budget", "12", "--max-new-tokens", "10", "--json"]
    assert main([*common, "--refresh", "0"]) == 0
    zero = json.loads(capsys.readouterr().out)
    assert main([*common, "--policy", "score-free"]) == 0
    score_free = json.loads(capsys.readouterr().out)
    assert zero["params"] == score_free["params"] and zero["params"]["refresh"] == 0
    assert [s["kept"] for s in zero["steps"]] == [s["kept"] for s in score_free["steps"]]


def test_a_trace_that_cannot_be_written_keeps_the_printed_result(tmp_path, capsys, monkeypatch):
    from kvviz.cli import main

    def disk_full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvviz.Trace, "save", disk_full)  # what no check before the run can foresee
    code = main(["generate", *TINY, "--prompt", TEXT, "--budget", "12", "--max-new-tokens", "4", "--json",
                 "--trace", str(tmp_path / "trace.parquet")])
    out, err = capsys.readouterr()
    assert code == 2 and "could not be written" in err and "No space left" in err
    assert len(json.loads(out)["token_ids"]) == 4


@pytest.mark.parametrize("where, message", [
    ("folder", "is a folder"),
    ("missing/trace.parquet", "does not exist"),
    ("file/trace.parquet", "is a file, not a folder"),
    ("trace.csv", "--trace writes a parquet file: name it .parquet, e.g. "),
])
def test_an_unwritable_trace_path_is_refused_before_the_model_loads(where, message, tmp_path, capsys, monkeypatch):
    from kvviz.cli import main

    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the --trace path was checked")

    monkeypatch.setattr("kvviz.models.load_model", no_loading)
    code = main(["generate", *TINY, "--prompt", TEXT, "--trace", str(tmp_path / where)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "--trace" in err and message in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_a_trace_folder_without_write_permission_is_refused(tmp_path, capsys):
    from kvviz.cli import main

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(["generate", *TINY, "--prompt", TEXT, "--trace", str(locked / "t.parquet")]) == 2
    assert "not writable" in capsys.readouterr().err


def test_static_json_stays_strict_json_when_no_step_was_steady(capsys):
    from kvviz.cli import main

    assert main(["generate", *TINY, "--prompt", TEXT, "--static", "--budget", "12", "--max-new-tokens", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda constant: pytest.fail(f"{constant} in JSON"))
    assert out["decode_tok_per_s"] is None and len(out["token_ids"]) == 2


@pytest.mark.parametrize("policy, new_tokens", [("inertia-lazy", 14), ("score-free", 9), ("inertia", 2),
                                                ("inertia", 1)])
def test_static_json_steps_are_the_engines(policy, new_tokens, capsys):
    """``--static --json`` has the engine's ``steps``: the same step, token_id, kept and evicted at every step
    (one token: no decode step on either path, although the static path runs step 1 anyway)."""
    from kvviz.cli import main

    common = ["generate", *TINY, "--prompt", TEXT, "--no-chat", "--policy", policy, "--compression", "0.7",
              "--max-new-tokens", str(new_tokens), "--json"]
    assert main(common) == 0
    engine = json.loads(capsys.readouterr().out)
    assert main([*common, "--static"]) == 0
    static = json.loads(capsys.readouterr().out)
    fields = ("step", "token_id", "kept", "evicted")
    assert len(engine["steps"]) == new_tokens - 1
    assert static["steps"] == [{name: step[name] for name in fields} for step in engine["steps"]]


def test_static_generate_prints_what_the_engine_generates(capsys):
    """``generate --static`` (the fast path) and the engine give the same tokens for the same InertiaKV."""
    from kvviz.cli import main

    common = ["generate", *TINY, "--prompt", TEXT, "--no-chat", "--policy", "inertia-lazy", "--compression", "0.7",
              "--max-new-tokens", "14", "--json"]
    assert main(common) == 0
    engine = json.loads(capsys.readouterr().out)
    assert main([*common, "--static"]) == 0
    static = json.loads(capsys.readouterr().out)
    assert static["path"] == "static" and static["budget"] == engine["budget"]
    assert static["token_ids"] == engine["token_ids"] and static["text"] == engine["text"]
    assert static["params"] == engine["params"] and static["params"]["refresh"] == 4


def test_argument_errors_are_one_line(capsys):
    from kvviz.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--compression", "0.5"])  # neither --prompt nor --prompt-file
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--prompt" in lines[0]


def test_batches_are_refused_with_a_clear_error(tiny):
    import torch

    import kvviz

    model, _ = tiny
    with kvviz.attach(model, "inertia", compression=0.5) as cache:
        with pytest.raises(ValueError, match="batch size 1"):
            model.generate(torch.ones(2, 8, dtype=torch.long), **{kvviz.engine.cache_kwarg(model): cache},
                           max_new_tokens=2)


def test_unknown_model_fails_with_one_clear_line(tmp_path):
    proc = kvviz_cli("generate", "--model", str(tmp_path / "no-such-model"), "--prompt", "hi")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and "no-such-model" in lines[-1] and len(lines) == 1


def _every_parser(parser, name="kvviz"):
    import argparse

    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from _every_parser(sub, f"{name} {command}")


def test_every_option_has_help_that_names_its_default():
    """`kvviz probe --help` showed --seed, --chat and --json bare and --step, --future, --batch without their
    defaults; `kvviz bench probe --help` had no help at all for most options."""
    import argparse

    from kvviz.cli import build_parser

    missing = []
    for name, parser in _every_parser(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = formatter._expand_help(action) if action.help else ""
            default = action.default
            value = "" if isinstance(default, bool) else f"{default:g}" if isinstance(default, float) else str(default)
            stated = "default" in text and value in text  # a flag on by default: the word is enough
            if not text or (default not in (None, argparse.SUPPRESS) and default is not False and not stated):
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
            # one wording per option across subcommands (bench speed's --device said only "e.g. cuda")
            wording = {"--device": "cpu, cuda or cuda:N", "--compression": "rho in [0, 1)"}
            for option in set(action.option_strings) & set(wording):
                if wording[option] not in text:
                    missing.append(f"{name} {option}: not '{wording[option]}'")
    assert not missing


def readme_cli_lines() -> list[str]:
    """The command lines of the README's Command line section, then of docs/cli.md's Examples, comment lines
    left out."""
    root = Path(__file__).resolve().parent.parent
    readme, cli = (root / "README.md").read_text(), (root / "docs" / "cli.md").read_text()
    blocks = [re.search(r"```bash\n(.*?)```", text.split(f"\n## {heading}\n", 1)[1], flags=re.S).group(1)
              for text, heading in ((readme, "Command line"), (cli, "Examples"))]
    return [line for block in blocks for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readmes_command_lines_parse_and_make_every_file_they_read(tmp_path):
    """The examples read haystack.txt, notes.txt and run.parquet, which none of them made: copied as written,
    they failed with 'cannot read --prompt-file' and 'run.parquet does not exist'."""
    from kvviz.cli import build_parser

    parser, traces, followed = build_parser(), set(), []
    for line in readme_cli_lines():
        words = shlex.split(line, comments=True)
        if words[0] != ".venv/bin/kvviz":  # a shell line that writes a file the examples read: run as written
            command = line.replace("python3", shlex.quote(sys.executable), 1) if words[0] == "python3" else line
            assert subprocess.run(command, shell=True, cwd=tmp_path).returncode == 0, line
            continue
        args = parser.parse_args(words[1:])  # an option that does not exist exits here
        if getattr(args, "prompt_file", None):
            assert (tmp_path / args.prompt_file).exists(), f"{line!r} reads a file no line before it writes"
        if args.command == "trace":
            assert args.file in traces, f"{line!r} opens a trace no `generate --trace` before it saves"
        if args.command == "generate" and args.trace:
            traces.add(args.trace)
        if getattr(args, "follow", None):
            followed.append(args.follow)
    assert followed and all(text in (tmp_path / "haystack.txt").read_text() for text in followed)


def test_policies_lists_the_registry(capsys):
    from kvviz.cli import main
    from kvviz.policies import REGISTRY

    assert main(["policies", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert set(listed) == set(REGISTRY)
    lazy = {p["name"]: p for p in listed["inertia-lazy"]["parameters"]}
    assert lazy["refresh"]["default"] == 4 and lazy["alpha"]["low"] == 0.0 and lazy["alpha"]["high"] == 1.0
    assert main(["policies"]) == 0
    printed = capsys.readouterr().out
    # 'layers' has no range: its help followed after four spaces, as if a column were missing
    assert "--param layers=all  eligible layers" in printed and "--param layers=all    " not in printed


def test_policies_prints_decoupled_alpha_as_the_previous_step_weight(capsys):
    from kvviz.cli import main

    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()

    def alpha_help(policy: str) -> str:  # the first --param alpha line after the policy's own line
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{policy} "))
        return next(line for line in lines[start + 1:] if "--param alpha=" in line)

    assert "previous step keeps alpha" in alpha_help("inertia-decoupled")
    assert "alpha**K" not in alpha_help("inertia-decoupled")
    assert "alpha**K" in alpha_help("inertia")  # InertiaKV's own help is still right for InertiaKV


# ------------------------------------------------------------------------------------------- results, bench

def _store_root(folder):
    """A results folder with one sweep of two measured rows (task single_needle, policies full and inertia)."""
    sweep = folder / "mini"
    sweep.mkdir(parents=True)
    rows = [{"sweep": "mini", "source": "measured", "model": "tiny-random-llama", "task": "single_needle",
             "policy": policy, "params": {}, "compression": 0.5, "metric": "string_match", "score": 1.0,
             "sample": 0, "seed": 0, "max_new_tokens": 8, "chat": False} for policy in ("full", "inertia")]
    (sweep / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.mark.parametrize("filters, message", [
    (["--task", "bogus"], "--task bogus: not in the results under"),
    (["--policies", "inertia,bogus"], "--policies bogus: not in the results under"),
    (["--model", "bogus"], "--model bogus: not in the results under"),
    (["--sweeps", "mini,bogus"], "--sweeps bogus: not in the results under"),
])
def test_results_names_an_unknown_filter_value_and_the_stored_ones(filters, message, tmp_path, capsys):
    from kvviz.cli import main

    root = _store_root(tmp_path)
    assert main(["results", "--root", str(root), *filters]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err
    stored = {"--task": "single_needle", "--policies": "full, inertia", "--model": "tiny-random-llama",
              "--sweeps": "mini"}[filters[0]]
    assert f"stored: {stored}" in err


def test_results_with_an_empty_policies_list_says_so(tmp_path, capsys):
    """It said 'no rows for these filters together', as if the store lacked them."""
    from kvviz.cli import main

    assert main(["results", "--root", str(_store_root(tmp_path)), "--policies", ","]) == 2
    assert capsys.readouterr().err == ("kvviz: error: --policies names no policy; give registry names, e.g. "
                                       "--policies inertia,tova, or leave it out for every policy\n")


def test_results_sweeps_keeps_the_cells_those_sweeps_ran(tmp_path, capsys):
    """The tab's Sweeps filter, on the command line: a second sweep's sample of inertia scored 0, so the mean
    over both sweeps is 0.5, over either alone 1 or 0."""
    from kvviz.cli import main

    root = _store_root(tmp_path)
    other = root / "other"
    other.mkdir()
    (other / "rows.jsonl").write_text(json.dumps(
        {"sweep": "other", "source": "measured", "model": "tiny-random-llama", "task": "single_needle",
         "policy": "inertia", "params": {}, "compression": 0.5, "metric": "string_match", "score": 0.0, "sample": 1,
         "seed": 0, "max_new_tokens": 8, "chat": False}) + "\n")

    def inertia(*flags) -> str:
        assert main(["results", "--root", str(root), "--policies", "inertia", *flags]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("inertia")).split()[1]

    assert (inertia(), inertia("--sweeps", "mini"), inertia("--sweeps", "other")) == ("0.500", "1.000", "0.000")
    assert inertia("--sweeps", "mini,other") == "0.500"
    assert main(["results", "--root", str(root), "--paper", "RULER", "--sweeps", "mini"]) == 2
    assert "drop --sweeps" in capsys.readouterr().err


def test_results_with_valid_filters_prints_the_table(tmp_path, capsys):
    from kvviz.cli import main

    assert main(["results", "--root", str(_store_root(tmp_path)), "--task", "single_needle",
                 "--policies", "inertia"]) == 0
    assert "single_needle" in capsys.readouterr().out


@pytest.mark.parametrize("folders", [[], ["."], ["./sweep-without-rows"]])  # no root; empty; no shard
def test_results_without_any_sweep_says_where_it_looked(folders, tmp_path, capsys):
    from kvviz.cli import main

    root = tmp_path / "results"
    for folder in folders:
        (root / folder).mkdir(parents=True)
    assert main(["results", "--root", str(root), "--task", "single_needle"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"no sweep results under {root} (expected {root}/<sweep>/rows*.jsonl" in err
    assert "filters" not in err


def test_bench_run_writes_where_results_reads_by_default(tmp_path, monkeypatch, capsys):
    """Without --out, ``bench run`` uses the store's folder (kvviz.store.ROOT), not ./results_db."""
    from pathlib import Path

    import kvviz.store
    from kvviz.bench import sweep
    from kvviz.cli import main

    config = Path(__file__).parent / "fixtures" / "sweep_tiny.toml"
    monkeypatch.setattr(kvviz.store, "ROOT", tmp_path / "store_root")
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(sweep, "status", lambda config, out: seen.append(Path(out)) or {})
    assert main(["bench", "run", str(config), "--status"]) == 0
    assert seen == [tmp_path / "store_root" / "tiny-test"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["bench", "run", "--help"])
    assert "kvviz.store.ROOT" in " ".join(capsys.readouterr().out.split())  # the default, said in --help


def test_decoupled_offers_only_the_aggregation_it_runs(capsys):
    """inertia-decoupled is one EMA per step: 'sum' is not offered (it was listed, then refused)."""
    from kvviz.cli import main

    assert main(["generate", "--model", "tiny-random-llama", "--prompt", "hello there", "--policy",
                 "inertia-decoupled", "--param", "aggregation=sum", "--budget", "2", "--max-new-tokens", "2"]) == 2
    assert "aggregation must be one of ema, got 'sum'" in capsys.readouterr().err


def test_trace_command_summarises_a_run_and_follows_its_tokens(tiny, tmp_path, capsys):
    import io

    import numpy as np
    import pandas as pd

    from kvviz import diagnostics
    from kvviz.cli import main

    model, tokenizer = tiny
    prompt = "The passkey is 71432. Remember it. The grass is green. " * 8
    trace = kvviz.run(model, tokenizer, prompt, "inertia", chat=False, compression=0.8, max_new_tokens=16).trace
    trace.model = "tiny-random-llama"
    trace.save(tmp_path / "run.parquet")
    assert main(["trace", str(tmp_path / "run.parquet")]) == 0
    out = capsys.readouterr().out
    evictions = sum(e.evicted.size for e in trace.events)
    assert f"budget B = {trace.budget} (compression ρ = 0.8), 15 decode steps, {evictions} evictions" in out
    assert "prompt (as is): 'The passkey is 71432. Remember it. The grass is green. The passkey is...'" in out
    assert f"utility churn           {diagnostics.summary(trace)['utility_churn']:.4f}" in out
    # Following the passkey's text: every position whose token holds part of it, each with its own fate.
    tokens = [tokenizer.decode([i]) for i in trace.prompt_ids]
    assert main(["trace", str(tmp_path / "run.parquet"), "--follow", "71432"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected, _ = diagnostics.find_positions(tokens, "71432")
    rows = {int(line.split()[0]): line for line in lines[2:]}
    assert sorted(rows) == sorted(expected) and len(expected) >= 8  # eight occurrences, in pieces
    for position, line in rows.items():
        step = next((e.step for e in trace.events if position in e.evicted), None)
        assert (f"evicted at step {step}" if step is not None else "kept") in line
    # --csv: the per-step history itself.
    assert main(["trace", str(tmp_path / "run.parquet"), "--follow", "#0-2", "--csv"]) == 0
    text = capsys.readouterr().out
    frame = pd.read_csv(io.StringIO(text))
    reference = diagnostics.token_history(trace.events, [0, 1, 2])
    assert ".0," not in text and ".0\n" not in text  # a whole rank is written 165, not 165.0
    assert frame[["step", "position", "kept"]].equals(reference[["step", "position", "kept"]])
    assert np.allclose(frame["raw_rank"], reference["raw_rank"], equal_nan=True)
    assert main(["trace", str(tmp_path / "run.parquet"), "--follow", "zzz"]) == 2
    assert "no token text contains 'zzz'" in capsys.readouterr().err


def test_generate_and_trace_say_which_rate_includes_the_prefill(tiny, tmp_path, capsys):
    """generate printed "24 new tokens at 4.4 tok/s" (the prefill's time in it) and trace, on the same run,
    "decode 9.5 tok/s" (without it): each now says which, in the same words."""
    from kvviz.cli import main

    assert main(["generate", *TINY, "--prompt", TEXT, "--policy", "inertia", "--budget", "20", "--max-new-tokens",
                 "4", "--trace", str(tmp_path / "run.parquet")]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"new tokens at \d+\.\d tok/s including the prefill "
                     r"\(decode \d+\.\d tok/s without the prefill\)$", summary), summary
    assert main(["trace", str(tmp_path / "run.parquet")]) == 0
    assert any(re.match(r"decode \d+\.\d tok/s without the prefill: forward \d+%", line)
               for line in capsys.readouterr().out.splitlines())


def test_a_checkpointed_run_that_ends_before_its_first_checkpoint_says_so(tiny, tmp_path, capsys):
    """generate (text and --json) and trace say why AvoKV-E's cache ended over B with nothing evicted."""
    from kvviz.cli import main

    _, tokenizer = tiny
    budget = len(tokenizer(TEXT, add_special_tokens=False)["input_ids"]) - 2  # over B at once; forced cut at step 14
    args = ["generate", *TINY, "--prompt", TEXT, "--no-chat", "--policy", "avokv", "--budget", str(budget),
            "--param", "interval=16"]
    note = ("no checkpoint reached: avokv evicts every 16 generated tokens, first at step 14 here, and this run "
            "ended at step 7; the cache was not cut")
    assert main([*args, "--max-new-tokens", "8", "--trace", str(tmp_path / "short.parquet")]) == 0
    assert capsys.readouterr().err.endswith(f" tok/s without the prefill)\n-- {note}\n")
    assert main([*args, "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["note"] == note
    assert main(["trace", str(tmp_path / "short.parquet")]) == 0
    lines = capsys.readouterr().out.splitlines()  # the run, the prompt it ran from, then why
    assert lines[1].startswith("prompt (as is): 'The quick") and lines[2] == note
    assert kvviz.Trace.load(tmp_path / "short.parquet").compression is None  # the budget was given in tokens
    # A run past its first checkpoint has no note (its cache may still be over B, as between any checkpoints).
    assert main([*args, "--max-new-tokens", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["note"] is None and any(step["evicted"] for step in out["steps"])
    assert main([*args, "--max-new-tokens", "20"]) == 0
    assert "no checkpoint" not in capsys.readouterr().err


def test_trace_options_another_view_would_drop_are_refused(tiny, tmp_path, capsys):
    """--csv without --follow printed the summary; --read-lag printed its table whatever --follow or --csv said."""
    from kvviz.cli import main

    model, tokenizer = tiny
    # a run whose read lags print (attention scored every step, nothing evicted), so that only the options refuse
    trace = kvviz.run(model, tokenizer, "The grass is green. " * 4, "inertia", chat=False, budget=200,
                      max_new_tokens=48).trace
    trace.save(tmp_path / "run.parquet")
    assert main(["trace", str(tmp_path / "run.parquet"), "--read-lag"]) == 0
    capsys.readouterr()
    for args, message in (
            (["--csv"], "--csv prints the followed tokens' steps; add --follow TEXT_OR_POSITIONS"),
            (["--read-lag", "--follow", "#0"], "--read-lag prints its own table over every generated entry, which "
                                               "--follow would not change: drop --follow, "
                                               "or run it without --read-lag"),
            (["--read-lag", "--csv"], "which --csv would not change: drop --csv"),
            (["--read-lag", "--follow", "#0", "--csv"], "which --follow and --csv would not change: drop --follow "
                                                        "and --csv")):
        assert main(["trace", str(tmp_path / "run.parquet"), *args]) == 2, args
        captured = capsys.readouterr()
        assert not captured.out and captured.err.count("\n") == 1 and message in captured.err, args


def test_an_empty_follow_or_a_folder_is_refused_not_read_as_something_else(tiny, tmp_path, capsys):
    """--follow "" printed the run's summary as if --follow were not given; a folder was read as an arrow
    dataset and refused for some other file in it, its path cut to 'u/err.txt'."""
    from kvviz.cli import main

    model, tokenizer = tiny
    kvviz.run(model, tokenizer, TEXT, "inertia", budget=20, max_new_tokens=4).trace.save(tmp_path / "run.parquet")
    (tmp_path / "notes.txt").write_text("not a trace")
    for args, message in (
            ([str(tmp_path / "run.parquet"), "--follow", ""], "--follow is empty; give text to find"),
            ([str(tmp_path / "run.parquet"), "--follow", "  ", "--csv"], "--follow is empty"),
            ([str(tmp_path)], f"{tmp_path} is a folder; give the path of a trace file (.parquet)")):
        assert main(["trace", *args]) == 2, args
        captured = capsys.readouterr()
        assert not captured.out and captured.err.count("\n") == 1 and message in captured.err, args


def test_generate_json_carries_each_checkpoints_terms(capsys):
    """AvoKV-E with a checkpoint every 4 tokens: exactly the steps that evicted carry `components`, one value
    per entry present, null for the protected tail (the newest 32 then) and for the sinks' S, and the kept
    judged entries are the top of S."""
    from kvviz.cli import main

    assert main(["generate", *TINY, "--prompt", TEXT, "--no-chat", "--policy", "avokv", "--budget", "40",
                 "--param", "interval=4", "--max-new-tokens", "12", "--json"]) == 0
    def not_json(constant):
        raise AssertionError(f"{constant} is not JSON")

    out = json.loads(capsys.readouterr().out, parse_constant=not_json)  # strict: no NaN or Infinity
    decided = [step for step in out["steps"] if "components" in step]
    assert decided and [s["step"] for s in decided] == [s["step"] for s in out["steps"] if s["evicted"]]
    for step in decided:
        present = sorted(step["kept"] + step["evicted"])
        terms = step["components"]
        assert all(len(values) == len(present) for values in terms.values())
        assert terms["p"][-32:] == [None] * 32 and sum(v is None for v in terms["S"]) == 32 + 4  # tail, sinks
        scores = dict(zip(present, terms["S"]))
        kept = [scores[p] for p in step["kept"] if scores[p] is not None]
        evicted = [scores[p] for p in step["evicted"]]
        assert max(evicted) <= min(kept)


def test_probe_blindspot_prints_avokvs_grid_and_its_test(capsys):
    import json

    from kvviz.cli import main

    args = ["probe", *TINY, "--prompt", TEXT * 3, "--no-chat", "--step", "3", "--future", "2", "--policies", "tova",
            "--blindspot"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    spot = report["blindspot"]
    assert set(report["ranking"]) == {"tova"}  # AvoKV-E's ranks are the grid's axes, not one more row here
    judged = sum(map(sum, spot["grid_entries"]))
    assert judged == spot["entries_in"] + spot["entries_out"] and 0 < judged < len(report["candidates"])
    assert sum(map(sum, spot["grid_high_damage"])) == spot["high_damage_in"] + spot["high_damage_out"] >= 1
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "N(b) \\ N(p)" in out
    assert f"N(p) <= 0.2, N(b) >= 0.8: {spot['high_damage_in']}/{spot['entries_in']} high-damage" in out
    # a cache within AvoKV-E's protected tail: the ranking still prints, the blindspot says why it is missing
    short = ["probe", *TINY, "--prompt", "The passkey is 71432.", "--no-chat", "--step", "2", "--future", "2",
             "--policies", "tova", "--blindspot"]
    assert main(short) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("tova") and "blindspot: AvoKV-E judges nothing at step 2" in out
    assert main([*short, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["blindspot"]["none"].startswith("AvoKV-E judges nothing")


def test_trace_read_lag_needs_an_attention_run_that_scored_every_step_and_kept_the_cache(tiny, tmp_path, capsys):
    from kvviz import diagnostics
    from kvviz.cli import main

    model, tokenizer = tiny
    prompt = "The grass is green. " * 4
    whole = kvviz.run(model, tokenizer, prompt, "inertia", chat=False, budget=200, max_new_tokens=48).trace
    whole.save(tmp_path / "whole.parquet")
    assert main(["trace", str(tmp_path / "whole.parquet"), "--read-lag"]) == 0
    out = capsys.readouterr().out
    lags = diagnostics.read_lags(whole.events, whole.prompt_len)
    split = diagnostics.read_lag_split(lags)
    assert f"{lags.positions.size} generated entries with 32 later queries ({lags.dropped} too near the end" in out
    # each decode step's query is one generated entry; an entry needs 32 queries after it
    assert lags.positions.size == len(whole.decode_steps) - 32 > 0
    row = next(line for line in out.splitlines() if line.startswith("N(early) >= 0.6"))
    assert row.split()[4] == str(split["high"]["entries"])
    assert "the split says nothing about delayed reads here" not in out  # read later here (F(1) = 0%)
    # Every entry read at once (as SmolLM2 does over 64 tokens): the table is all 100%, and says why.
    at_once = {group: {**split[group], "read_by": dict.fromkeys(split[group]["read_by"], 1.0), "never": 0.0}
               for group in ("low", "high")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(diagnostics, "read_lag_split", lambda lags: {**split, **at_once})
        assert main(["trace", str(tmp_path / "whole.parquet"), "--read-lag"]) == 0
    assert "every entry was strongly read at lag 1: the split says nothing about delayed reads here" in \
        capsys.readouterr().out
    for policy, budget, reason in (("inertia-lazy", 200, "scores every step"),  # not every step
                                   ("knorm", 200, "does not record attention"),  # a key norm is no read
                                   ("inertia", 30, "evicted entries")):  # evicted entries are never read again
        run = kvviz.run(model, tokenizer, prompt, policy, chat=False, budget=budget, max_new_tokens=40).trace
        run.save(tmp_path / f"{policy}.parquet")
        assert main(["trace", str(tmp_path / f"{policy}.parquet"), "--read-lag"]) == 2
        assert reason in capsys.readouterr().err


def test_probe_ranks_every_policy_on_the_entries_all_of_them_judged(capsys):
    import numpy as np

    from kvviz.cli import main

    args = ["probe", *TINY, "--prompt", TEXT * 3, "--no-chat", "--step", "3", "--future", "2",
            "--policies", "tova,avokv"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    newest = report["prompt_len"] + 3 - 1  # the step's own entry; candidates are everything before it
    assert report["candidates"] == list(range(newest))
    # AvoKV-E (a budget under 768 tokens: W_delay = 32) never judges its 4 sinks nor the 32 newest entries,
    # the step's own among them; TOVA judges all: both are ranked on the rest.
    assert report["ranked"] == list(range(4, newest - 31))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"ranked over the {newest - 35} entries every policy judged (35 left out" in out
    # why 32: AvoKV-E is scored at a checkpoint with B = the cache less one, under 768, and says so
    assert f"never judged: avokv the first 4 and the newest 32 (the step's own among them) (B = {newest}) (set one " \
           "as a parameter" in out
    # k is the top damage decile of those ranked entries (np.quantile's 90th percentile, ties included)
    ranked = np.array(report["damage"])[report["ranked"]]
    k = int((ranked >= np.quantile(ranked, 0.9)).sum())
    assert f"(label: the top decile of damage, k = {k} of {newest - 35} entries; p: the AUROC against chance" in out
    # each row is the JSON's ranking, false-safe rate included (the share of the k in its k lowest utilities)
    for name, quality in report["ranking"].items():
        row = next(line for line in out.splitlines() if line.startswith(name + " ")).split()
        p_value = "<0.001" if quality["auroc_p"] < 0.001 else f"{quality['auroc_p']:.3f}"  # not "0.000"
        assert row[1:] == [f"{quality[key]:.3f}" if key != "auroc_p" else p_value
                           for key in ("auroc", "auroc_p", "average_precision", "topk_recall", "false_safe_rate",
                                       "spearman")]
        assert 0 <= quality["auroc_p"] <= 1
    assert main([*args[:-1], "tova", "--json"]) == 0  # one policy that judges everything: nothing left out
    assert json.loads(capsys.readouterr().out)["ranked"] == list(range(newest))
    # a setting, as the note offers: AvoKV-E with the delay of a large budget judges all but its 8 newest
    assert main([*args[:-1], "tova,avokv delay=8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranked"] == list(range(4, newest - 7)) and set(report["ranking"]) == {"tova", "avokv delay=8"}


def test_probe_names_a_ranking_that_is_mostly_one_tied_score_and_prints_small_p_values_as_such(capsys, monkeypatch):
    """As the app does: TOVA's utility made all 0 but one entry reads as mostly one tied score, with its share;
    a p-value under 0.001 prints as "<0.001", not as a certain "0.000"."""
    import numpy as np

    import kvviz.probe
    from kvviz.cli import main

    real = kvviz.probe.probe

    def tova_all_tied(*args, **kwargs):
        result = real(*args, **kwargs)
        result.utilities["tova"] = np.where(np.arange(len(result.candidates)) == 0, 1.0, 0.0)
        result.utilities["h2o"] = result.damage.copy()  # a perfect ranking of many entries: p far under 0.001
        return result

    monkeypatch.setattr(kvviz.probe, "probe", tova_all_tied)
    assert main(["probe", *TINY, "--prompt", TEXT * 3, "--no-chat", "--step", "3", "--future", "2",
                 "--policies", "tova,h2o"]) == 0
    out = capsys.readouterr().out
    entries = int(out.split("probe at step 3: ")[1].split()[0])  # all ranked: both judge every candidate
    tova_share = (entries - 1) / entries
    assert f"(mostly one tied score: tova ({tova_share:.0%}) of the ranked entries share it" in out
    assert next(line for line in out.splitlines() if line.startswith("h2o ")).split()[2] == "<0.001"


def test_a_sampled_runs_trace_says_how_it_decoded(tmp_path, capsys):
    import kvviz
    from kvviz.cli import main

    path = tmp_path / "sampled.parquet"
    common = ["generate", *TINY, "--prompt", TEXT, "--no-chat", "--budget", "12", "--max-new-tokens", "8"]
    assert main([*common, "--temperature", "0.7", "--top-p", "0.9", "--seed", "5", "--trace", str(path)]) == 0
    capsys.readouterr()
    trace = kvviz.Trace.load(path)
    assert trace.sampling == {"temperature": 0.7, "top_p": 0.9, "seed": 5}
    model, tokenizer = kvviz.load_model("tiny-random-llama")  # the same draw through the library
    expected = kvviz.run(model, tokenizer, TEXT, "inertia", chat=False, budget=12, max_new_tokens=8,
                         temperature=0.7, top_p=0.9, seed=5)
    assert trace.token_ids == expected.token_ids
    assert main(["trace", str(path)]) == 0
    assert "sampled at temperature 0.7, top-p 0.9, seed 5: prompt" in capsys.readouterr().out
    assert main([*common, "--trace", str(path)]) == 0  # greedy: nothing recorded, nothing said
    capsys.readouterr()
    assert kvviz.Trace.load(path).sampling == {}
    assert main(["trace", str(path)]) == 0
    assert "sampled" not in capsys.readouterr().out


def test_a_trace_with_malformed_sampling_is_refused_saying_so(tmp_path):
    import kvviz

    model, tokenizer = kvviz.load_model("tiny-random-llama")
    trace = kvviz.run(model, tokenizer, TEXT, "inertia", chat=False, budget=12, max_new_tokens=3).trace
    trace.sampling = {"temperature": 0.7}  # no top_p, no seed
    trace.save(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="sampling .*empty \\(greedy\\) or an object of temperature, top_p and an "
                                         "integer seed"):
        kvviz.Trace.load(tmp_path / "bad.parquet")


def test_the_full_cache_is_not_reported_as_holding_a_budget(capsys, tmp_path):
    """One command line for every policy may give --budget to full too: it evicts nothing, and says so rather
    than print a budget next to a larger final cache; `kvviz trace` of that run said 'budget B = 10'."""
    from kvviz.cli import main

    trace = str(tmp_path / "full.parquet")
    assert main(["generate", *TINY, "--prompt", TEXT, "--policy", "full", "--budget", "10", "--max-new-tokens",
                 "3", "--trace", trace]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    prompt_len = int(summary.split("prompt ")[1].split()[0])
    assert f"no eviction (full cache), final cache {prompt_len + 2}," in summary and "budget" not in summary
    assert main(["trace", trace]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"prompt {prompt_len} tokens, no eviction (full cache), 2 decode steps" in first and "B =" not in first
    assert main(["trace", trace, "--follow", "#0"]) == 0
    assert capsys.readouterr().out.startswith("1 position(s); no eviction (full cache); ranks count from 1")


def test_scorers_steps_past_the_context_names_steps(capsys):
    """It said 'max_new_tokens (5001) ... generate fewer tokens': scorers has no such option."""
    from kvviz.cli import main

    assert main(["scorers", *TINY, "--prompt", TEXT, "--steps", "5000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps 5000 decodes 5001 tokens after this" in err
    assert "beyond the model's context of 4096; choose --steps" in err and "max_new_tokens" not in err


def test_scorers_names_a_small_top_b_share_as_it_is(capsys):
    """At compression 0.999 the header said 'top-B at 0%' for a B of 1."""
    from kvviz.cli import main

    assert main(["scorers", *TINY, "--prompt", TEXT, "--steps", "2", "--compression", "0.999"]) == 0
    assert "top-B at 0.1% (B = 1)" in capsys.readouterr().out.splitlines()[0]


def test_the_parser_is_built_without_torch_or_transformers():
    """Every subcommand's --help, and every mistyped option, is answered before a model library loads: they
    cost the command line seconds on each call (6 s on a 2-core machine) before it printed a word."""
    code = ("import sys; from kvviz.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'pandas') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    # the library surface still resolves through the package, names and submodules alike
    proc = subprocess.run([sys.executable, "-c", "import kvviz; print(kvviz.run.__module__, kvviz.Trace.__name__, "
                           "kvviz.engine.__name__, 'run' in dir(kvviz))"], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["kvviz.engine", "Trace", "kvviz.engine", "True"], proc.stderr
