"""The documents a user reads: short pages, no history in them, links that resolve, and an
options reference that is the configs' own.

History (dates, commit hashes, issue numbers) belongs to CHANGELOG.md and commit messages;
figures to bench/. A page that grows past its limit is split into sub-pages.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README_LIMIT = 8 * 1024
PAGE_LIMIT = 12 * 1024
HISTORY = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"  # a date
    r"|\b[Ii]ssues? #?\d+"  # an issue number
    r"|(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"  # a commit hash
)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def generator():
    spec = importlib.util.spec_from_file_location("generate_reference", DOCS / "generate_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pages_are_short():
    assert len((REPO / "README.md").read_bytes()) <= README_LIMIT
    long = {p.relative_to(REPO).as_posix(): len(p.read_bytes()) for p in DOCS.rglob("*.md")}
    assert {p: n for p, n in long.items() if n > PAGE_LIMIT} == {}


def test_no_history_in_the_docs_or_the_help():
    found = []
    for page in pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            # A link's target may name a dated report (bench/reports/<date>-<name>.md): a
            # file name, not history told on the page.
            if match := HISTORY.search(re.sub(r"\]\([^)]*\)", "]", line)):
                found.append(f"{page.relative_to(REPO)}:{number}: {match.group(0)}")
    # --help prints each job's docstring and every option's help (the reference holds the
    # latter, checked above; the docstrings here).
    for job in sorted((REPO / "jobs").glob("*.py")):
        text = job.read_text()
        doc = re.match(r'\s*"""(.*?)"""', text, re.S)
        for match in HISTORY.finditer(doc.group(1) if doc else ""):
            found.append(f"{job.relative_to(REPO)} docstring: {match.group(0)}")
    assert found == []


def test_the_history_check_catches_history():
    for text in ("since 2026-11-27", "issue 36 asks", "at commit 7dfee15", "(ded0529..7dfee15)"):
        assert HISTORY.search(text), text
    for text in ("ami-0123456789abcdef0", "10,938 passages/s", "sha256", "IVF4096,PQ64", "deadbeef"):
        assert not HISTORY.search(text), text


def test_relative_links_resolve():
    broken = []
    for page in [*pages(), *sorted((REPO / "cluster").rglob("*.md")), *sorted((REPO / "bench").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert broken == []


def test_the_options_reference_is_generated_from_the_configs():
    reference = generator()
    expected = reference.render()
    on_disk = {p.relative_to(DOCS / "reference").as_posix(): p.read_text() for p in (DOCS / "reference").rglob("*.md")}
    stale = sorted(set(expected) ^ set(on_disk)) + sorted(
        k for k in expected if on_disk.get(k, expected[k]) != expected[k]
    )
    assert not stale, f"regenerate it: python docs/generate_reference.py ({stale[:5]})"
    # Every job is in it, with every option --help lists.
    from pipeline.core.config import describe

    for job, (cls, _) in reference.job_configs().items():
        options, _ = describe(cls)
        text = "".join(v for k, v in expected.items() if k == f"{job}.md" or k.startswith(f"{job}/"))
        missing = [o.path for o in options if f"`--{o.path}`" not in text]
        assert not missing, (job, missing[:5])


@pytest.mark.parametrize("job", ["encode", "recipe"])
def test_help_groups_options_by_section(job, capsys):
    spec = importlib.util.spec_from_file_location(f"job_{job}", REPO / "jobs" / f"{job}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    out = capsys.readouterr().out
    assert "[encoder]" in out if job == "encode" else "[round1.train]" in out


def bench_figures():
    spec = importlib.util.spec_from_file_location("figures", REPO / "bench" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_figures_are_generated_from_the_results_files(tmp_path, monkeypatch):
    """bench/README.md's figures are what bench/results/*.json render, every results file is
    rendered somewhere, and a figure changed in a results file makes the page stale."""
    figures = bench_figures()
    assert figures.main(["--check"]) == 0, "regenerate them: python bench/figures.py"
    results = tmp_path / "results"
    results.mkdir()
    for path in figures.RESULTS.glob("*.json"):
        (results / path.name).write_text(path.read_text())
    monkeypatch.setattr(figures, "RESULTS", results)
    assert figures.main(["--check"]) == 0
    changed = results / "drain_move-cpu-2core.json"
    changed.write_text(changed.read_text().replace('"results_equal": true', '"results_equal": false'))
    assert figures.main(["--check"]) == 1
    (results / "unplaced-cpu.json").write_text('{"x": 1}')
    assert figures.main(["--check"]) == 1


def test_the_deploy_pages_access_commands_name_what_render_writes():
    """The Secrets the deploy page makes are the ones the rendered cluster reads (Ray's token
    through authOptions, the checkpoint key through every pod's env), and its port-forward
    names the rendered head's Service and dashboard port. Mutation: values.yaml's
    ray_token_secret renamed: the page's command no longer makes the Secret the cluster reads."""
    import yaml

    spec = importlib.util.spec_from_file_location("render", REPO / "cluster" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    files = render.render(yaml.safe_load((REPO / "cluster" / "values.yaml").read_text()))
    cluster = yaml.safe_load(files["kuberay/raycluster.yaml"])
    token_secret = cluster["spec"]["authOptions"]["secretName"]
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    (key_env,) = [e for e in head["env"] if e["name"] == "RAYDENSE_CHECKPOINT_KEY"]
    key_ref = key_env["valueFrom"]["secretKeyRef"]
    (dashboard,) = [p["containerPort"] for p in head["ports"] if p["name"] == "dashboard"]
    page = (DOCS / "deploy.md").read_text()
    assert f"kubectl create secret generic {token_secret} --from-literal=auth_token=" in page
    assert f"kubectl create secret generic {key_ref['name']} --from-literal={key_ref['key']}=" in page
    assert f"kubectl port-forward service/{cluster['metadata']['name']}-head-svc {dashboard}:{dashboard}" in page
    assert f"kubectl get secret {token_secret} -o jsonpath='{{.data.auth_token}}'" in page
    assert f"--address http://127.0.0.1:{dashboard}" in page
    access = (DOCS / "operations" / "access.md").read_text()
    assert "file://cluster/rendered/aws-ingress.json" in access and "aws-ingress.json" in files


def test_the_tutorials_commands_are_jobs_and_its_printed_keys_are_the_codes_own():
    """Every command of docs/tutorial.md runs a job that exists, and every key its example
    lines show (summaries, log lines) is one the code writes: a quoted literal in
    ``pipeline/`` or ``jobs/``. Mutation: the log line's ``eta_s`` renamed in the worker
    leaves the tutorial's key unknown."""
    text = (DOCS / "tutorial.md").read_text()
    blocks = re.findall(r"```(\w+)\n(.*?)```", text, re.S)
    commands = [line for kind, body in blocks if kind == "bash" for line in body.splitlines() if line.strip()]
    assert commands and all((REPO / line.split()[1]).is_file() for line in commands), commands
    code = "\n".join(p.read_text() for folder in ("pipeline", "jobs") for p in (REPO / folder).rglob("*.py"))
    keys = {key for kind, body in blocks if kind == "json" for key in re.findall(r'"(\w+)":', body)}
    assert {"step", "of", "eta_s", "job", "metrics"} <= keys
    unknown = sorted(key for key in keys if f'"{key}"' not in code)
    assert not unknown, f"docs/tutorial.md shows keys no code writes: {unknown}"
