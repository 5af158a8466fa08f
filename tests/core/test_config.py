"""Tests for pipeline.core.config. The future import makes every dataclass below string-annotated,
which is how job modules are written, so resolution via get_type_hints is exercised throughout."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import pytest
import yaml

from pipeline.core.config import Renamed, check_inputs, dump_yaml, from_dict, parse_config, redact, to_dict, truthy
from pipeline.core.errors import ConfigError


@dataclass
class Optim:
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class Train:
    epochs: int = field(default=1, metadata={"help": "passes over the data"})
    warmup_steps: Optional[int] = None
    optim: Optim = field(default_factory=Optim)

    def __post_init__(self):
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")


@dataclass
class Data:
    pack: bool = field(default=True, metadata={"help": "pack short passages together"})
    tokenizer: str | None = "bert-base-uncased"
    shards: list[str] = field(default_factory=list)


@dataclass
class Shard:
    path: str
    weight: float = 1.0


@dataclass
class Job:
    method: Literal["condenser", "cocondenser", "simlm"] = field(
        default="condenser", metadata={"help": "pre-training recipe"}
    )
    seed: int = 0
    ranks: list[int] = field(default_factory=lambda: [0])
    extra: dict[str, Any] = field(default_factory=dict)
    train: Train = field(default_factory=Train, metadata={"help": "optimisation"})
    data: Data = field(default_factory=lambda: Data(pack=False))  # customised section default
    hf_token: str | None = "hf_from_env"  # stands in for a default read from the environment
    mix: list[Shard] = field(default_factory=list)


def parse(*argv: str) -> Job:
    return parse_config(Job, list(argv))


@pytest.fixture
def yaml_file(tmp_path: Path):
    def write(text: str, name: str = "c.yaml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


def test_defaults_are_fresh_per_call():
    a, b = parse(), parse()
    assert a == Job(train=Train(), data=Data(pack=False))
    assert a.data.pack is False and a.data.tokenizer == "bert-base-uncased"  # factory default kept
    assert a.train.optim.lr == 1e-3 and a.ranks == [0]
    a.train.optim.betas.append(1.0)
    a.ranks.append(5)
    assert b.train.optim.betas == [0.9, 0.999] and b.ranks == [0] and a.train is not b.train


def test_yaml_override_converts_types(yaml_file):
    path = yaml_file("""
        method: simlm
        train:
          epochs: 3
          optim: {lr: 1e-4, betas: [1, 0.5]}
        data:
          shards: [a, b]
        extra: {k: [1, 2]}
    """)
    cfg = parse("--config", path)
    assert cfg.method == "simlm" and cfg.train.epochs == 3
    assert cfg.train.optim.lr == 1e-4  # PyYAML reads 1e-4 as the string "1e-4"
    assert isinstance(cfg.train.optim.lr, float)
    assert cfg.train.optim.betas == [1.0, 0.5] and isinstance(cfg.train.optim.betas[0], float)
    assert cfg.data.shards == ["a", "b"] and cfg.extra == {"k": [1, 2]}
    assert cfg.data.pack is False and cfg.seed == 0  # untouched values keep their defaults


def test_cli_beats_yaml_and_later_yaml_beats_earlier(yaml_file):
    first = yaml_file("seed: 1\ntrain: {epochs: 2, optim: {lr: 0.1}}\n", "a.yaml")
    second = yaml_file("seed: 2\ntrain: {optim: {lr: 0.2}}\n", "b.yaml")
    cfg = parse("--config", first, "--config", second)
    assert (cfg.seed, cfg.train.epochs, cfg.train.optim.lr) == (2, 2, 0.2)
    cfg = parse("--train.optim.lr", "3e-4", "--config", first, "--config=" + second)
    assert (cfg.seed, cfg.train.epochs, cfg.train.optim.lr) == (2, 2, 3e-4)


def test_dotted_and_equals_syntax():
    cfg = parse(
        "--train.epochs",
        "4",
        "--train.optim.lr=0.5",
        "--method=cocondenser",
        "--seed",
        "-3",
        "--train.warmup-steps",
        "10",
    )
    assert (cfg.train.epochs, cfg.train.optim.lr, cfg.method) == (4, 0.5, "cocondenser")
    assert cfg.seed == -3
    assert cfg.train.warmup_steps == 10


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--data.pack", "true"], True),
        (["--data.pack=no"], False),
        (["--data.pack", "1"], True),
        (["--data.pack", "0"], False),
        (["--data.pack", "yes"], True),
        (["--data.pack"], True),
        (["--data.pack", "--seed", "1"], True),
        (["--data.pack", "--no-data.pack"], False),
    ],
)
def test_bool_forms(argv, expected):
    assert parse(*argv).data.pack is expected


def test_none_lists_and_dicts_from_cli():
    cfg = parse(
        "--train.warmup_steps",
        "100",
        "--data.tokenizer",
        "none",
        "--ranks",
        "0,1",
        "--data.shards=x, y",
        "--extra",
        '{"a": 1, "b": [true]}',
    )
    assert cfg.train.warmup_steps == 100 and cfg.data.tokenizer is None
    assert cfg.ranks == [0, 1] and cfg.data.shards == ["x", "y"]
    assert cfg.extra == {"a": 1, "b": [True]}
    assert parse("--train.warmup_steps", "null").train.warmup_steps is None
    assert parse("--ranks", "").ranks == []


def test_literal_choice_error_lists_allowed_values():
    with pytest.raises(ConfigError, match="'bert' is not one of 'condenser', 'cocondenser', 'simlm'"):
        parse("--method", "bert")


def test_unknown_yaml_key_names_file_and_suggests(yaml_file):
    path = yaml_file("train:\n  optim:\n    lrr: 0.1\n")
    with pytest.raises(ConfigError, match="did you mean") as exc:
        parse("--config", path)
    assert "'train.optim.lrr'" in str(exc.value) and path in str(exc.value)
    assert "did you mean 'train.optim.lr'" in str(exc.value)


def test_unknown_cli_option_suggests():
    with pytest.raises(ConfigError, match=r"option --train\.epoch; did you mean '--train\.epochs'"):
        parse("--train.epoch", "3")
    with pytest.raises(ConfigError, match=r"did you mean '--train\.optim\.lr'"):
        parse("--lr", "3")
    with pytest.raises(ConfigError, match="is a section"):
        parse("--train", "3")


def test_bad_values_name_key_type_and_source(yaml_file):
    with pytest.raises(ConfigError, match=r"'train\.epochs' from the command line.*got 'three'"):
        parse("--train.epochs", "three")
    path = yaml_file("train:\n  optim:\n    lr: fast\n")
    with pytest.raises(ConfigError, match="invalid value for 'train.optim.lr'") as exc:
        parse("--config", path)
    assert str(exc.value) == f"invalid value for 'train.optim.lr' from config file '{path}': expected float, got 'fast'"
    with pytest.raises(ConfigError, match=r"expected int \| None"):
        parse("--train.warmup_steps", "soon")
    with pytest.raises(ConfigError, match=r"expected int, got True"):
        from_dict(Job, {"seed": True})
    with pytest.raises(ConfigError, match=r"'ranks\[1\]'"):
        parse("--ranks", "0,x")
    with pytest.raises(ConfigError, match="expects a value"):
        parse("--seed")


def test_bad_yaml_files(yaml_file, tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        parse("--config", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        parse("--config", yaml_file("- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"section 'train' .* must be a mapping"):
        parse("--config", yaml_file("train: 3\n"))
    assert parse("--config", yaml_file("")) == parse()


def test_post_init_error_names_section():
    with pytest.raises(ConfigError, match=r"invalid section 'train': epochs must be >= 1, got 0"):
        parse("--train.epochs", "0")


def test_cli_mode_exits_2_with_error_on_stderr(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["job", "--train.epoch", "3"])
    with pytest.raises(SystemExit) as exc:
        parse_config(Job)
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown option --train.epoch")


def test_help_lists_dotted_options_types_defaults_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(Job, ["--help"], description="Pre-train an encoder.")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in [
        "Pre-train an encoder.",
        "--config FILE",
        "--train.optim.lr float",
        "peak learning rate (default: 0.001)",
        "--data.pack bool",
        "pack short passages together (default: false)",
        "--train.warmup_steps int | None",
        "(default: none)",
        "--method {condenser,cocondenser,simlm}",
        "pre-training recipe (default: condenser)",
        "--ranks list[int]",
        "(default: 0)",
        "[train.optim]",
        "optimisation",
        "--data.shards list[str]",
        "(default: [])",
        "--hf_token str | None",
        "(default: ***)",
        "--mix list[Shard]",
    ]:
        assert text in out, text
    assert "hf_from_env" not in out


def test_to_dict_dump_yaml_round_trip():
    cfg = parse(
        "--train.optim.lr", "2e-5", "--data.shards", "s3://b/x", "--extra", '{"n": {"m": 1}}', "--hf_token", "abc"
    )
    cfg.mix = [Shard("a", 2.0)]
    data = to_dict(cfg)
    assert data["train"]["optim"] == {"lr": 2e-5, "betas": [0.9, 0.999]}
    assert from_dict(Job, data) == cfg
    assert from_dict(Job, yaml.safe_load(dump_yaml(cfg, redact_secrets=False))) == cfg
    saved = yaml.safe_load(dump_yaml(cfg))
    assert saved["hf_token"] == "***" and saved["data"]["tokenizer"] == "bert-base-uncased"


def test_from_dict_validates_like_yaml():
    with pytest.raises(ConfigError, match=r"'data\.pak' in run\.json; did you mean 'data\.pack'"):
        from_dict(Job, {"data": {"pak": True}}, source="run.json")
    assert from_dict(Job, {"data": {"pack": "yes"}}).data == Data(pack=True)


def test_redact_rules():
    secret = {
        "token": "t",
        "api_token": "t",
        "authToken": "t",
        "HFToken": "t",
        "HF_TOKEN": "t",
        "aws_secret_access_key": "s",
        "AWS_ACCESS_KEY_ID": "k",
        "db_password": "p",
        "Credentials": {"a": 1},
    }
    public = {
        "unset_token": None,
        "tokenizer": "bert",
        "max_tokens": 512,
        "tokens_per_s": 9.5,
        "pad_token_id": 0,
        "token_type_ids": [0],
    }
    d = {**secret, **public, "nested": [{"secret": "x", "name": "n"}]}
    out = redact(d)
    assert out == {**{k: "***" for k in secret}, **public, "nested": [{"secret": "***", "name": "n"}]}
    assert d["token"] == "t" and d["nested"][0]["secret"] == "x"  # input untouched


@dataclass
class Required:
    path: str
    train: Train = field(default_factory=Train)


def test_required_field_and_unsupported_type():
    with pytest.raises(ConfigError, match="missing required option 'path'"):
        parse_config(Required, [])
    assert parse_config(Required, ["--path", "/x"]).path == "/x"
    with pytest.raises(TypeError, match="unsupported type"):
        parse_config(Unsupported, [])


@dataclass
class Unsupported:
    things: set = field(default_factory=set)


def test_list_of_dataclasses_from_yaml(yaml_file):
    cfg = parse("--config", yaml_file("mix:\n  - {path: a, weight: 2}\n  - {path: b}\n"))
    assert cfg.mix == [Shard("a", 2.0), Shard("b", 1.0)]
    with pytest.raises(ConfigError, match=r"key 'mix\[0\]\.wieght' .*mean 'mix\[0\]\.weight'"):
        parse("--config", yaml_file("mix:\n  - {path: a, wieght: 2}\n"))


@dataclass
class _NoRayJob:
    size: int = 1


@pytest.mark.parametrize(
    "raised, shown",
    [
        (ConfigError("--model.init runs/x: no such directory"), "error: --model.init runs/x: no such directory"),
        # Raised on an actor: Ray wraps it; the job still prints the user's error alone.
        ("actor", "error: queries.jsonl line 3: duplicate query id 'q1'"),
        # A full disk, as Python's files and as pyarrow's writers (text only) report it.
        (
            OSError(28, "No space left on device", "/data/run/state.pt"),
            "error: no space left writing /data/run/state.pt ([Errno 28] No space left on device: "
            "'/data/run/state.pt'): free space there, or give the outputs a larger disk, then rerun "
            "the same command: what was finished is kept",
        ),
        (
            "pyarrow",
            "error: no space left writing the outputs (Error writing bytes to file. Detail: [errno 28] "
            "No space left on device): free space there, or give the outputs a larger disk, then rerun "
            "the same command: what was finished is kept",
        ),
    ],
)
def test_a_user_error_or_a_full_disk_prints_one_line_and_exits_2(raised, shown, monkeypatch, capsys):
    from ray.exceptions import RayTaskError

    from pipeline.core.entry import run_job
    from pipeline.core.errors import InputError

    if raised == "actor":
        raised = RayTaskError("encode", "Traceback ...", InputError("queries.jsonl line 3: duplicate query id 'q1'"))
    if raised == "pyarrow":
        full = OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")
        raised = RayTaskError("write", "Traceback ...", full)

    def run(cfg):
        raise raised

    monkeypatch.setattr(sys, "argv", ["job"])
    monkeypatch.delenv("RAYDENSE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exited:
        run_job(_NoRayJob, run, "a job")
    assert exited.value.code == 2 and capsys.readouterr().err.strip() == shown
    # RAYDENSE_DEBUG=1 shows the traceback; a crash (not our error) always does.
    monkeypatch.setenv("RAYDENSE_DEBUG", "1")
    with pytest.raises(type(raised)):
        run_job(_NoRayJob, run, "a job")
    monkeypatch.delenv("RAYDENSE_DEBUG")
    with pytest.raises(ZeroDivisionError):
        run_job(_NoRayJob, lambda cfg: 1 / 0, "a job")


@dataclass
class Encoder:
    RENAMED: ClassVar[dict] = {"max_len": Renamed("passage_max_len")}

    passage_max_len: int = 128
    similarity: Literal["", "dot", "cos"] = ""


@dataclass
class Evaluate:
    RENAMED: ClassVar[dict] = {
        "max_len": Renamed("encoder.passage_max_len"),
        "normalize": Renamed("encoder.similarity", convert=lambda v: "cos" if truthy(v) else "", flag=True),
    }

    encoder: Encoder = field(default_factory=Encoder)
    k: int = 10


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--max_len", "64"], (64, "")),
        (["--max_len=64", "--normalize"], (64, "cos")),
        (["--normalize", "false", "--k", "3"], (128, "")),
        (["--encoder.max_len", "32"], (32, "")),  # renamed inside the section too
        (["--encoder.passage_max_len", "16", "--encoder.similarity", "dot"], (16, "dot")),
    ],
)
def test_renamed_options_are_read_as_their_new_keys(argv, expected, capsys):
    cfg = parse_config(Evaluate, argv)
    assert (cfg.encoder.passage_max_len, cfg.encoder.similarity) == expected
    used_old_names = {a.split("=")[0] for a in argv} & {"--max_len", "--normalize", "--encoder.max_len"}
    assert ("is now --encoder." in capsys.readouterr().err) == bool(used_old_names)


def test_renamed_yaml_keys_and_their_values_are_converted_and_checked(yaml_file, capsys):
    cfg = parse_config(Evaluate, ["--config", yaml_file("max_len: 48\nnormalize: true\nencoder: {max_len: 40}\n")])
    assert (cfg.encoder.passage_max_len, cfg.encoder.similarity) == (40, "cos")  # later key wins
    assert "note: 'max_len' in config file" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"encoder\.passage_max_len"):
        parse_config(Evaluate, ["--max_len", "many"])


def test_a_rename_to_no_option_is_a_programming_error():
    @dataclass
    class Broken:
        RENAMED: ClassVar[dict] = {"old": Renamed("nowhere")}
        here: int = 0

    with pytest.raises(TypeError, match="old is renamed to nowhere"):
        parse_config(Broken, [])


@dataclass
class _Checked:
    path: str = "missing"
    enabled: bool = True

    def check_inputs(self, prefix: str) -> None:
        raise ConfigError(f"{prefix}path {self.path}: nothing there")


@dataclass
class _Stages:
    uses_model: bool = True
    model: _Checked = field(default_factory=_Checked)
    extra: _Checked = field(default_factory=lambda: _Checked(enabled=False))

    def check_inputs(self, prefix: str) -> tuple[str, ...]:
        return () if self.uses_model else ("model",)


def test_sections_a_run_does_not_use_are_not_checked():
    """A disabled section, and one its parent names unused, are not refused for what they
    hold; a used one is, by its option's name. Mutation: the walker checks every section."""
    with pytest.raises(ConfigError, match=r"^--model\.path missing"):
        check_inputs(_Stages())
    check_inputs(_Stages(uses_model=False))
    with pytest.raises(ConfigError, match=r"^--extra\.path"):
        check_inputs(_Stages(uses_model=False, extra=_Checked()))
