"""``moeplan --config FILE.toml``: a command's options from a TOML table, the command line
winning over the file, and one-line errors for tables and keys that name nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli.main import main
from planner.predict.split import split_trace
from planner.solve.plan import Plan
from planner.trace import open_trace
from planner.trace.synth import SynthConfig
from tests.conftest import synth_predictor

SYNTH = SynthConfig(
    num_layers=2, num_experts=8, top_k=2, vocab_size=200, num_tokens=3000, num_requests=30,
    affinity=0.9, seed=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("config")
    trace = synth_predictor(d, SYNTH)
    split_trace(trace, d / "fit", d / "held", 0.5, seed=0)
    return d


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "moeplan.toml"
    path.write_text(text)
    return str(path)


def test_options_come_from_the_file_and_the_command_line_wins(setup, tmp_path, capsys):
    cfg = _config(
        tmp_path,
        """
[solve]
method = "kmeans"
ep = 4
options = { kmeans = { n_init = 2 } }

[trace.split]
holdout = 0.25
""",
    )
    pred = str(setup / "pred")
    assert main(["--config", cfg, "solve", pred, "--out", str(tmp_path / "a")]) == 0
    plan = Plan.load(tmp_path / "a")
    assert (plan.method, plan.ep_size) == ("kmeans", 4)
    assert plan.config["options"] == {"kmeans": {"n_init": 2}}
    args = ["--config", cfg, "solve", pred, "--out", str(tmp_path / "b"), "--method", "vanilla"]
    assert main(args) == 0
    assert (Plan.load(tmp_path / "b").method, Plan.load(tmp_path / "b").ep_size) == ("vanilla", 4)
    # a nested table sets a subcommand of a group
    trace = str(setup / "trace")
    args = ["trace", "split", trace, "--fit-out", str(tmp_path / "f"), "--heldout-out"]
    assert main(["--config", cfg, *args, str(tmp_path / "h")]) == 0
    held = len(open_trace(tmp_path / "h").request_ids())
    assert held == round(0.25 * SYNTH.num_requests)


def test_a_list_becomes_a_comma_separated_option(setup, tmp_path, capsys):
    cfg = _config(tmp_path, '[compare]\nmethods = ["vanilla", "kmeans"]\nep = 2\njson = true\n')
    capsys.readouterr()
    assert main(["--config", cfg, "compare", str(setup / "pred"), str(setup / "held")]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["method"] for r in rows] == ["vanilla", "kmeans"]


def test_a_list_goes_to_an_argument_of_several_values_and_a_file_expert_beta_gives_way(
    setup, tmp_path, capsys
):
    # trace ingest's dumps took the list joined by commas ("Value must be an iterable")
    cfg = _config(
        tmp_path, f'[trace.ingest.sglang]\ndumps = ["{tmp_path}/a.pt", "{tmp_path}/b.pt"]\n'
    )
    capsys.readouterr()
    assert main(["--config", cfg, "trace", "ingest", "sglang", "--out", str(tmp_path / "t")]) == 2
    assert f"{tmp_path}/a.pt: no such SGLang dump" in capsys.readouterr().err
    # one string where several may go ("Value must be an iterable", naming no file)
    cfg = _config(tmp_path, f'[trace.ingest.sglang]\ndumps = "{tmp_path}/dumps"\n')
    assert main(["--config", cfg, "trace", "ingest", "sglang", "--out", str(tmp_path / "t")]) == 2
    assert f"{tmp_path}/dumps: no such SGLang dump" in capsys.readouterr().err
    # the file's expert-beta is for the methods it applies to: --method vanilla typed on the
    # command line was refused as if --expert-beta had been typed with it
    cfg = _config(tmp_path, "[solve]\nep = 4\nexpert-beta = 1.25\n")
    args = ["--config", cfg, "solve", str(setup / "pred"), "--out", str(tmp_path / "v")]
    assert main([*args, "--method", "vanilla"]) == 0
    assert Plan.load(tmp_path / "v").method == "vanilla"
    assert (
        main([*args[:-2], str(tmp_path / "w"), "--method", "vanilla", "--expert-beta", "1.2"]) == 2
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("[solv]\nep = 4\n", "[solv] names no command here; tables: compare, evaluate"),
        (
            "[solve]\nepp = 4\n",
            "'epp' is not an option here; options: align-to, batch-prices, beta, chain-passes, ep,",
        ),
        ("[trace]\nsplit = 1\n", "split must be a table of its options"),
        ("[solve\n", "not valid TOML"),
    ],
)
def test_tables_and_keys_that_name_nothing_are_one_line_errors(
    setup, tmp_path, capsys, text, message
):
    cfg = _config(tmp_path, text)
    capsys.readouterr()
    args = ["--config", cfg, "solve", str(setup / "pred"), "--out", str(tmp_path / "p")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeplan: error: --config") and message in err and "\n" not in err
    assert not (tmp_path / "p").exists()


def test_a_missing_config_file(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "none.toml"), "trace", "info", "x"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_the_example_config_names_only_real_options():
    import typer

    from planner.cli.app import app
    from planner.cli.config import load_config

    example = Path(__file__).parents[2] / "examples" / "moeplan.toml"
    defaults = load_config(str(example), typer.main.get_command(app))
    assert defaults["solve"] == {"method": "ceo", "ep": 4, "jobs": 2}
    assert defaults["compare"]["methods"] == "ceo,metis,kmeans,alternating,ilp,vanilla"
    assert defaults["trace"]["split"] == {"holdout": 0.5, "seed": 0}


@pytest.mark.parametrize(
    "text, message",
    [
        ("[solve]\nep = true\n", "[solve]: ep must be an integer, not True"),
        ("[solve]\nep = 4.5\n", "[solve]: ep must be an integer, not 4.5"),
        ('[solve]\nep = "four"\n', "[solve]: ep must be an integer, not 'four'"),
        ('[solve]\nep = 2\nbeta = "x"\n', "[solve]: beta must be a number, not 'x'"),
        ('[solve]\nep = 2\nngram-defer = "no"\n', "ngram-defer must be true or false, not 'no'"),
        ("[solve]\nep = 2\ntime-limit = 1979-05-27\n", "time-limit must be a number"),
        ("[solve]\nep = 2\nmethod = true\n", "method must be a string, not True"),
        # a list or a table only where the option takes one: the list wrote to "a,b"
        ('[solve]\nep = 2\nout = ["a", "b"]\n', "out must be a string, not ['a', 'b']"),
        ("[solve]\nep = 2\nmethod = { a = 1 }\n", "method must be a string, not {'a': 1}"),
        # a TOML time inside the JSON of --options: json.dumps raised a TypeError traceback
        (
            "[solve]\nep = 2\noptions = { ceo = { time_budget = 00:05:00 } }\n",
            "options holds a value JSON cannot carry",
        ),
    ],
)
def test_values_of_the_wrong_type_are_one_line_errors(setup, tmp_path, capsys, text, message):
    """``ep = true`` was taken as EP 1 (a bool is an int to Python), and a string for a
    number was click's multi-line usage error that did not name the file."""
    cfg = _config(tmp_path, text)
    capsys.readouterr()
    args = ["--config", cfg, "solve", str(setup / "pred"), "--out", str(tmp_path / "p")]
    assert main([*args, "--method", "vanilla"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeplan: error: --config") and message in err and "\n" not in err
    assert not (tmp_path / "p").exists()


def test_non_utf8_config_is_one_line(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_bytes(b"[solve]\nep = 4\n\xff\xfe = 1\n")
    assert main(["--config", str(path), "trace", "info", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeplan: error: --config") and "not valid TOML" in err


def test_a_config_that_is_a_directory(tmp_path, capsys):
    assert main(["--config", str(tmp_path), "trace", "info", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a directory" in err and "\n" not in err


def test_a_files_export_values_give_way_to_what_is_typed(setup, tmp_path, capsys):
    """The file's [export] out refused a typed --verify ("drop --out", never typed), and its
    num-model-layers a typed --format moeplan: a value typed on the command line wins."""
    plan, bundle = tmp_path / "plan", tmp_path / "bundle"
    assert main(["solve", str(setup / "pred"), "--ep", "2", "--method", "vanilla",
                 "--out", str(plan)]) == 0  # fmt: skip
    cfg = _config(
        tmp_path,
        f'[export]\nout = "{tmp_path}/other"\nformat = "moeplan,sglang"\nnum-model-layers = 4\n',
    )
    capsys.readouterr()
    assert main(["--config", cfg, "export", str(plan), "--out", str(bundle),
                 "--format", "moeplan"]) == 0  # fmt: skip
    assert main(["--config", cfg, "export", "--verify", str(bundle)]) == 0
    assert not (tmp_path / "other").exists()
    capsys.readouterr()
    assert main(["export", "--verify", str(bundle), "--out", str(tmp_path / "x")]) == 2
    assert "drop --out" in capsys.readouterr().err


def test_a_vanilla_plan_records_only_what_it_ran(setup, tmp_path):
    """The file's chain-passes and CEO options went into a vanilla plan's plan.json, which
    then claimed a chain polish and CEO options that never ran."""
    cfg = _config(
        tmp_path, "[solve]\nep = 2\nchain-passes = 1\noptions = { ceo = { effort = 1000 } }\n"
    )
    out = tmp_path / "v"
    assert main(["--config", cfg, "solve", str(setup / "pred"), "--method", "vanilla",
                 "--out", str(out)]) == 0  # fmt: skip
    config = json.loads((out / "plan.json").read_text())["config"]
    assert config["chain_passes"] == 0 and config["options"] == {}


def test_compare_refuses_typed_options_for_a_method_it_does_not_run(setup, tmp_path, capsys):
    """`compare --methods kmeans --options '{"ceo": ...}'` ran without the options or a word
    (`solve` refused the same); a --config file's options may cover more methods."""
    args = ["compare", str(setup / "pred"), str(setup / "held"), "--ep", "2"]
    args += ["--methods", "kmeans,vanilla"]
    assert main([*args, "--options", '{"ceo": {"effort": 5}}']) == 2
    err = capsys.readouterr().err
    assert "--options sets 'ceo', not among --methods kmeans,vanilla" in err
    cfg = _config(tmp_path, "[compare]\noptions = { ceo = { effort = 5 } }\n")
    assert main(["--config", cfg, *args, "--json"]) == 0
    assert [r["method"] for r in json.loads(capsys.readouterr().out)["rows"]] == [
        "kmeans",
        "vanilla",
    ]


def test_an_empty_path_from_the_file_is_refused_too(setup, tmp_path, monkeypatch, capsys):
    """`align-to = ""` read the folder the command ran in as the deployed plan."""
    cfg = _config(tmp_path, '[solve]\nep = 2\nalign-to = ""\n')
    monkeypatch.chdir(tmp_path)
    args = ["--config", cfg, "solve", str(setup / "pred"), "--out", str(tmp_path / "o")]
    assert main(args) == 2
    assert capsys.readouterr().err == "moeplan: error: --align-to is empty; give a path\n"
