"""The bad-input corpus: malformed traces, SLO strings, energy and quality specs, search spaces, configs,
profiles, storage URLs and studies, each run through the CLI beside an existing study and an existing
tuned file. Shared by tests/reliability/test_bad_input.py and benchmarks/reliability.py.

Each input must give exit code 2, exactly one line on stderr that contains ``expect`` (what is wrong),
no traceback, and leave every file of the existing study's folder byte-identical.
"""
from __future__ import annotations

import gzip
import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path

from reliability_helpers import PROFILE, SLO
from typer.testing import CliRunner

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:15:46.68,30,4\n"
SPACE_HEAD = "name: mine\ndescription: test space\nknobs:\n"
PROFILE_TEXT = PROFILE.read_text(encoding="utf-8")

# input files, written to <folder>/inputs: name -> content
INPUT_FILES: dict[str, str | bytes] = {
    "empty.csv": "", "header_only.csv": AZURE, "not_int.csv": AZURE + ROW + "2023-11-16 18:15:47.68,abc,4\n",
    "negative.csv": AZURE + "2023-11-16 18:15:46.68,-3,4\n",
    "huge.csv": AZURE + f"2023-11-16 18:15:46.68,{10 ** 25},4\n",  # beyond int64
    "binary.csv": b"\x00\xff\xfe\x89PNG\r\n\x1a\n" * 20, "unknown.csv": "a,b,c\n1,2,3\n",
    "broken.jsonl": '{"timestamp": 0, "input_length": 6, "output_length": 3}\n{"timestamp": 1, "input_length"\n',
    "nan.jsonl": '{"timestamp": NaN, "input_length": 5, "output_length": 3}\n',
    "truncated.csv.gz": gzip.compress((AZURE + ROW * 50).encode())[:60],
    "bad_yaml.yaml": "knobs: [\n", "list.yaml": "- a\n- b\n", "empty.yaml": "",
    "unknown_knob.yaml": SPACE_HEAD + "  batching.nope: {choices: [1, 2]}\n",
    "low_high.yaml": SPACE_HEAD + "  batching.max_num_seqs: {low: 64, high: 8}\n",
    "not_json.json": "{not json", "list.json": "[1, 2]", "empty_object.json": "{}",
    "binary.json": b"\xff\xfe\x00\x01", "other_format.json": '{"format": "other", "version": 1}',
    "truncated.json": PROFILE_TEXT[:5000],
    "c_bad_yaml.yaml": "batching: [\n", "c_unknown.yaml": "batching:\n  nope: 1\n",
    "c_range.yaml": "batching:\n  max_num_seqs: 0\n", "c_type.yaml": "batching:\n  max_num_seqs: many\n",
    "c_list.yaml": "- 1\n", "c_family.yaml": "turbo:\n  on: true\n", "c_bad.json": "{",
    "c_host_tier.yaml": "offload:\n  host_kv_bytes: 512TiB\n", "c_ok.yaml": "{}\n",
    "c_not_mapping.yaml": "batching: 5\n", "garbage.db": b"not a database" * 100,
    # not UTF-8; names and values with square brackets (rich markup if printed unescaped)
    "c_not_utf8.yaml": b"\xff\xfe\x00garbage", "c_not_utf8.json": b"\xff\xfe\x00garbage",
    "not_utf8.yaml": b"\xff\xfe\x00garbage", "c[b]_unknown.yaml": "batching:\n  nope: 1\n",
    "[red]space.yaml": SPACE_HEAD + "  batching.nope: {choices: [1, 2]}\n",
    # the baseline's chunk (2048 tokens) over the fixed step budget: the first trial could not be built
    "lossy_fixed.yaml": SPACE_HEAD + "  batching.max_num_seqs: {low: 8, high: 64}\n"
                        "fixed:\n  eviction.policy: h2o\n  eviction.budget_fraction: 0.5\n",
    "clash.yaml": SPACE_HEAD + "  batching.chunk_size: {low: 64, high: 4096}\n"
                  "fixed:\n  batching.max_num_batched_tokens: 1024\n",
}


@dataclass(frozen=True)
class BadInput:
    name: str
    kind: str  # trace, slo, energy, quality, space, profile, config, storage, study, option, usage
    argv: tuple[str, ...]  # {in}: the inputs folder; {db}/{pydb}: the existing studies; {out}; {profile}
    expect: str  # what the one-line error must name


OPTIMIZE = {"--slo": SLO, "--profile": "{profile}", "--requests": "16", "--trials": "1", "--validate": "0",
            "--storage": "{db}", "--study": "s", "--out": "{out}"}


def optimize(**changes: str | None) -> tuple[str, ...]:
    """`skistune optimize` on the existing study with some options changed (None: left out); option
    names are written without dashes, underscores for dashes (rate_scale=...)."""
    options = dict(OPTIMIZE)
    for key, value in changes.items():
        flag = "--" + key.replace("_", "-")
        options.pop(flag, None)
        if value is not None:
            options[flag] = value
    return ("optimize", *(x for pair in options.items() for x in pair))


OPTIMIZE_ARGV = optimize()  # the command that made the existing study


def trace(file: str) -> tuple[str, ...]:
    return optimize(workload=f"{{in}}/{file}", requests=None)  # --requests applies to presets only


def evaluate(file: str) -> tuple[str, ...]:
    return ("evaluate", file, "--requests", "4", "--profile", "{profile}")


def worker(storage: str, study: str = "s") -> tuple[str, ...]:
    return ("worker", "--storage", storage, "--study", study, "--trials", "1")


CASES: tuple[BadInput, ...] = (
    BadInput("trace missing", "trace", trace("no_such.csv"), "neither a preset"),
    BadInput("trace is a folder", "trace", optimize(workload="{in}", requests=None), "neither a preset"),
    BadInput("trace empty", "trace", trace("empty.csv"), "empty.csv: empty trace"),
    BadInput("trace header only", "trace", trace("header_only.csv"), "header_only.csv: empty trace"),
    BadInput("trace not an integer", "trace", trace("not_int.csv"), "not_int.csv:3: column ContextTokens"),
    BadInput("trace negative length", "trace", trace("negative.csv"), "negative length -3"),
    BadInput("trace length overflows int64", "trace", trace("huge.csv"), "huge.csv:2: column ContextTokens"),
    BadInput("trace binary", "trace", trace("binary.csv"), "binary.csv: not a text trace"),
    BadInput("trace unknown columns", "trace", trace("unknown.csv"), "unknown.csv: unknown trace format"),
    BadInput("trace broken JSON line", "trace", trace("broken.jsonl"), "broken.jsonl:2"),
    BadInput("trace NaN timestamp", "trace", trace("nan.jsonl"), "nan.jsonl:1: column timestamp"),
    BadInput("trace truncated gzip", "trace", trace("truncated.csv.gz"), "truncated.csv.gz: damaged gzip"),
    BadInput("trace with --requests", "trace", optimize(workload="{in}/not_int.csv"), "requests applies to presets"),
    BadInput("rate scale 0", "trace", optimize(rate_scale="0"), "rate scale must be > 0"),
    BadInput("rate scale inf", "trace", optimize(rate_scale="inf"), "rate scale must be > 0 and finite"),
    BadInput("length scale nan", "trace", optimize(length_scale="nan"), "length scale must be > 0"),
    BadInput("length scale inf", "trace", optimize(length_scale="inf"), "length scale must be > 0 and finite"),
    BadInput("slo wrong operator", "slo", optimize(slo="p99<200ms"), "SLO 'p99<200ms'"),
    BadInput("slo empty", "slo", optimize(slo=""), "SLO ''"),
    BadInput("slo unknown metric", "slo", optimize(slo="foo:p99<=1s"), "SLO 'foo:p99<=1s'"),
    BadInput("slo unknown percentile", "slo", optimize(slo="tbt:p42<=1s"), "SLO 'tbt:p42<=1s'"),
    BadInput("slo zero", "slo", optimize(slo="p99=0ms"), "the limit must be a positive, finite time"),
    BadInput("slo not a number", "slo", optimize(slo="p99=.ms"), "'.' is not a number"),
    BadInput("slo infinite", "slo", optimize(slo="p99=1e999ms"), "the limit must be a positive, finite time"),
    BadInput("slo unknown unit", "slo", optimize(slo="p99=200min"), "SLO 'p99=200min'"),
    BadInput("slo without a unit", "slo", optimize(slo="p99=200"), "the limit needs a unit: write 200ms or 0.2s"),
    BadInput("energy in watts", "energy", optimize(energy="0.5W"), "energy '0.5W'"),
    BadInput("energy zero", "energy", optimize(energy="0J/token"), "energy '0J/token': the budget must be positive"),
    BadInput("energy infinite", "energy", optimize(energy="1e999J/token"), "must be a finite number of joules"),
    BadInput("energy a word", "energy", optimize(energy="lots"), "energy 'lots'"),
    BadInput("quality decrease", "quality", optimize(quality="ppl-1%"), "quality 'ppl-1%'"),
    BadInput("quality needle > 1", "quality", optimize(quality="needle>=1.5"), "must be in (0, 1]"),
    BadInput("quality needle 0", "quality", optimize(quality="needle>=0"), "must be in (0, 1]"),
    BadInput("quality empty", "quality", optimize(quality=""), "quality ''"),
    BadInput("space unknown name", "space", optimize(space="nosuchspace"), "nosuchspace: no shipped search space"),
    BadInput("space missing file", "space", optimize(space="{in}/no_such.yaml"), "no_such.yaml: cannot read"),
    BadInput("space bad YAML", "space", optimize(space="{in}/bad_yaml.yaml"), "bad_yaml.yaml: not valid YAML"),
    BadInput("space a list", "space", optimize(space="{in}/list.yaml"), "list.yaml: expected a mapping"),
    BadInput("space empty", "space", optimize(space="{in}/empty.yaml"), "empty.yaml: expected a mapping"),
    BadInput("space unknown knob", "space", optimize(space="{in}/unknown_knob.yaml"), "batching.nope: unknown knob"),
    BadInput("space low above high", "space", optimize(space="{in}/low_high.yaml"), "low (64) must be below high"),
    BadInput("space and target", "space", optimize(space="default", target="vllm"), "give one"),
    BadInput("space fixes a lossy knob with no quality floor", "space", optimize(space="{in}/lossy_fixed.yaml"),
             "space mine: fixes eviction.policy: h2o, eviction.budget_fraction: 0.5, which changes the model's"),
    BadInput("space clashes with its fixed knobs", "space", optimize(space="{in}/clash.yaml"),
             "space mine: the point is not a valid config (batching.chunk_size: 2048 exceeds"),
    BadInput("profile missing", "profile", optimize(profile="{in}/no_such.json"), "no_such.json: cannot read"),
    BadInput("profile a folder", "profile", optimize(profile="{in}"), "cannot read profile"),
    BadInput("profile not JSON", "profile", optimize(profile="{in}/not_json.json"), "not_json.json: not valid JSON"),
    BadInput("profile a list", "profile", optimize(profile="{in}/list.json"), "list.json: profile: expected an object"),
    BadInput("profile empty object", "profile", optimize(profile="{in}/empty_object.json"), "profile.format: missing"),
    BadInput("profile binary", "profile", optimize(profile="{in}/binary.json"), "binary.json: not a profile"),
    BadInput("profile other format", "profile", optimize(profile="{in}/other_format.json"), "format: 'other'"),
    BadInput("profile truncated", "profile", optimize(profile="{in}/truncated.json"), "truncated or corrupted"),
    BadInput("profile of another model", "profile", optimize(model="llama-3-8b"), "measured for smollm2-135m"),
    BadInput("config missing", "config", evaluate("{in}/no_such.yaml"), "no_such.yaml: cannot read config"),
    BadInput("config a folder", "config", evaluate("{in}"), "cannot read config"),
    BadInput("config bad YAML", "config", evaluate("{in}/c_bad_yaml.yaml"), "c_bad_yaml.yaml: config: not valid YAML"),
    BadInput("config unknown knob", "config", evaluate("{in}/c_unknown.yaml"), "batching.nope: unknown knob"),
    BadInput("config out of range", "config", evaluate("{in}/c_range.yaml"), "max_num_seqs: 0 is outside"),
    BadInput("config wrong type", "config", evaluate("{in}/c_type.yaml"), "'many' is not a number"),
    BadInput("config a list", "config", evaluate("{in}/c_list.yaml"), "c_list.yaml: config: expected a mapping"),
    BadInput("config unknown family", "config", evaluate("{in}/c_family.yaml"), "turbo: unknown knob family"),
    BadInput("config bad JSON", "config", evaluate("{in}/c_bad.json"), "c_bad.json: config: not valid JSON"),
    # checked before the workload's notes are printed (the chat preset at 4 requests has one)
    BadInput("evaluate profile missing", "profile",
             ("evaluate", "{in}/c_ok.yaml", "--requests", "4", "--profile", "{in}/no_such.json"),
             "no_such.json: cannot read profile"),
    BadInput("evaluate host tier beyond memory", "config", ("evaluate", "{in}/c_host_tier.yaml", "--mode", "run",
                                                            "--requests", "4"), "host_kv_bytes: a 524288.0 GiB"),
    BadInput("config family not a mapping", "config", evaluate("{in}/c_not_mapping.yaml"), "batching: expected"),
    BadInput("storage not a URL", "storage", optimize(storage="not-a-url"), "storage 'not-a-url'"),
    BadInput("storage unknown scheme", "storage", optimize(storage="nosuch://x"), "storage nosuch://x: cannot open"),
    BadInput("storage port not a number", "storage", optimize(storage="postgresql://u@127.0.0.1:abc/db"),
             "storage postgresql://...: cannot open"),
    BadInput("storage refused, password hidden", "storage",
             optimize(storage="postgresql://u:secret@127.0.0.1:1/db"), "postgresql://u:***@127.0.0.1:1/db"),
    BadInput("storage folder missing", "storage", optimize(storage="sqlite:////no/such/dir/x.db"),
             "folder /no/such/dir does not exist"),
    BadInput("storage driver missing", "storage", optimize(storage="mysql://u@127.0.0.1/db"), "driver is not"),
    BadInput("storage not a database", "storage", optimize(storage="sqlite:///{in}/garbage.db"), "not a database"),
    BadInput("study of another problem", "study", optimize(slo="p99=300ms"), "created for another problem"),
    BadInput("worker: study missing", "study", worker("{db}", "nope"), "study 'nope': not in storage"),
    BadInput("worker: no database file", "study", worker("sqlite:///{in}/none.db"), "no such database file"),
    BadInput("worker: not a URL", "storage", worker("nope"), "storage 'nope'"),
    BadInput("worker: refused", "storage", worker("postgresql://u@127.0.0.1:1/db"), "cannot open"),
    BadInput("worker: not a database", "storage", worker("sqlite:///{in}/garbage.db"), "not a database"),
    BadInput("worker: study of Python code", "study", worker("{pydb}", "py"), "uses Python callables"),
    BadInput("objective unknown", "option", optimize(objective="throughput"), "objective 'throughput'"),
    BadInput("objective twice", "option", optimize(objective="capacity,capacity"), "names one objective twice"),
    BadInput("target unknown", "option", optimize(target="tgi"), "target 'tgi'"),
    BadInput("sampler unknown", "option", optimize(sampler="cmaes"), "--sampler 'cmaes'"),
    BadInput("max-queue not a time", "option", optimize(max_queue="soon"), "--max-queue 'soon'"),
    BadInput("out is a folder", "option", optimize(out="{in}"), "is a directory"),
    BadInput("out folder missing", "option", optimize(out="/no/such/dir/x.yaml"), "does not exist"),
    BadInput("config not UTF-8", "config", evaluate("{in}/c_not_utf8.yaml"), "c_not_utf8.yaml: not a config"),
    BadInput("export config not UTF-8", "config", ("export", "{in}/c_not_utf8.json", "--to", "vllm"),
             "c_not_utf8.json: not a config (not UTF-8"),
    BadInput("space not UTF-8", "space", optimize(space="{in}/not_utf8.yaml"), "not_utf8.yaml: not a search space"),
    BadInput("config named with brackets", "config", evaluate("{in}/c[b]_unknown.yaml"),
             "c[b]_unknown.yaml: batching.nope: unknown knob"),
    BadInput("space named like markup", "space", optimize(space="{in}/[red]space.yaml"),
             "[red]space.yaml: knobs: batching.nope: unknown knob"),
    BadInput("slo with brackets", "slo", optimize(slo="p99=[b]ms"), "SLO 'p99=[b]ms'"),
    # click's own errors, one line naming the command whose help to read
    BadInput("option without its value", "usage", ("profile", "--quick", "--show"),
             "error: Option '--show' requires an argument. (see skistune profile --help)"),
    BadInput("command unknown", "usage", ("nonexistent",), "error: No such command 'nonexistent'. (see skistune --help)"),
    BadInput("option unknown", "usage", optimize(zzz="1"), "No such option: --zzz (see skistune optimize --help)"),
    BadInput("option not an integer", "usage", optimize(trials="many"),
             "Invalid value for '--trials'"),
    BadInput("argument missing", "usage", ("export", "--to", "vllm"),
             "error: Missing argument 'CONFIG'. (see skistune export --help)"),
    BadInput("subcommand option unknown", "usage", ("workload", "show", "chat", "--nope"),
             "No such option: --nope (see skistune workload show --help)"),
    BadInput("option value of a subcommand missing", "usage", ("export", "{in}/c_bad.json", "--to"),
             "Option '--to' requires an argument. (see skistune export --help)"),
)


@dataclass(frozen=True)
class Paths:
    inputs: Path
    existing: Path  # the folder of the existing studies and tuned file: must stay byte-identical

    def fill(self, argv: tuple[str, ...]) -> list[str]:
        values = {"in": str(self.inputs), "db": f"sqlite:///{self.existing / 's.db'}",
                  "pydb": f"sqlite:///{self.existing / 'py.db'}", "out": str(self.existing / "tuned.yaml"),
                  "profile": str(PROFILE)}
        return [a.format(**values) for a in argv]


def prepare(folder: Path, profile) -> Paths:
    """The input files, an existing study with its tuned file (made by the CLI), and a study whose
    objective is a Python callable (made by the API)."""
    import skistune
    from skistune.cli import app
    from skistune.workloads import load_workload

    paths = Paths(folder / "inputs", folder / "existing")
    paths.inputs.mkdir(parents=True)
    paths.existing.mkdir(parents=True)
    for name, content in INPUT_FILES.items():
        target = paths.inputs / name
        target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content, encoding="utf-8")
    made = CliRunner().invoke(app, paths.fill(OPTIMIZE_ARGV))
    if made.exit_code != 0:
        raise RuntimeError(f"could not create the existing study: {made.output}")
    skistune.optimize(load_workload("chat", requests=16), objective=lambda metrics: metrics.duration_s,
                      profile=profile, storage=f"sqlite:///{paths.existing / 'py.db'}", study_name="py",
                      n_trials=1, validate=0)
    return paths



def snapshot(folder: Path) -> dict[str, str]:
    """Every file in the folder by SHA-256 (a file added or removed shows too)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@dataclass(frozen=True)
class Outcome:
    case: BadInput
    exit_code: int
    stderr_lines: tuple[str, ...]
    traceback: bool
    untouched: bool

    @property
    def handled(self) -> bool:
        return (self.exit_code == 2 and len(self.stderr_lines) == 1 and not self.traceback and self.untouched
                and self.case.expect in self.stderr_lines[0])


def run_case(case: BadInput, paths: Paths) -> Outcome:
    from skistune.cli import app

    before = snapshot(paths.existing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shipped profile's fingerprint note is not the point here
        result = CliRunner().invoke(app, paths.fill(case.argv))
    lines = tuple(line for line in result.stderr.strip().splitlines() if line.strip())
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    return Outcome(case, result.exit_code, lines, crashed or "Traceback" in result.output,
                   snapshot(paths.existing) == before)
