"""GitHub Actions workflows: linted by actionlint, and the promises the README makes.

- every `run:` step is bash that stops at the first error (`bash -eo pipefail {0}`);
- the CPU job runs exactly the README's test command, on a pinned Python 3.11 with a pip cache;
- the GPU job runs on the self-hosted GPU runner, calls `nvidia-smi` first, and runs the
  same command with TRANSFORMER_BOOK_DEVICE=cuda (so it cannot pass on a CPU);
- the book job builds with the README's build command, keeps the reports of a failed build,
  and deploys to GitHub Pages only from main;
- a weekly job executes every chapter inside Colab's runtime image with the GPU passed through;
- every action is pinned to a commit;
- the README's Python examples run as printed.

The self-hosted GPU runner's label is GPU_LABEL below; change it here and in the workflows.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from book_helpers import BUILD_ARGS, REPO_ROOT

WORKFLOWS_DIR = REPO_ROOT / ".github" / "workflows"
WORKFLOW_FILES = sorted([*WORKFLOWS_DIR.glob("*.yml"), *WORKFLOWS_DIR.glob("*.yaml")])
GPU_LABEL = "gpu"
GPU_RUNS_ON = ["self-hosted", GPU_LABEL]
DEVICE_ENV = "TRANSFORMER_BOOK_DEVICE"
COLAB_IMAGE = "us-docker.pkg.dev/colab-images/public/runtime"
MAIN_REF = "github.ref == 'refs/heads/main'"


# --------------------------------------------------------------------------- helpers


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    # YAML 1.1 reads the key `on` as the boolean True.
    if True in data and "on" not in data:
        data["on"] = data.pop(True)
    return data


WORKFLOWS = {path.name: _load(path) for path in WORKFLOW_FILES}


def _jobs():
    """(workflow file, workflow, job id, job) for every job."""
    for name, wf in WORKFLOWS.items():
        for job_id, job in (wf.get("jobs") or {}).items():
            yield name, wf, job_id, job


def _runs_on(job: dict) -> list[str]:
    runs_on = job.get("runs-on", [])
    return [runs_on] if isinstance(runs_on, str) else list(runs_on)


def _env(wf: dict, job: dict, step: dict | None = None) -> dict:
    env = dict(wf.get("env") or {})
    env.update(job.get("env") or {})
    if step:
        env.update(step.get("env") or {})
    return env


def _shell(wf: dict, job: dict, step: dict) -> str | None:
    for holder in (step, (job.get("defaults") or {}).get("run") or {}, (wf.get("defaults") or {}).get("run") or {}):
        if holder.get("shell"):
            return holder["shell"]
    return None


def _stops_at_first_error(shell: str | None) -> bool:
    """bash with -e and -o pipefail, its script as {0}: `bash -eo pipefail {0}` and the like."""
    if not shell:
        return False
    tokens = shell.split()
    if len(tokens) < 3 or tokens[0] != "bash" or tokens[-1] != "{0}":
        return False
    flags = tokens[1:-1]
    errexit = any(re.fullmatch(r"-[a-z]*e[a-z]*", t) for t in flags)
    pipefail = any(
        re.fullmatch(r"-[a-z]*o", t) and i + 1 < len(flags) and flags[i + 1] == "pipefail" for i, t in enumerate(flags)
    )
    return errexit and pipefail


def _uses(step: dict) -> str:
    return (step.get("uses") or "").split("@")[0]


def _steps_using(job: dict, action: str) -> list[dict]:
    return [s for s in job.get("steps", []) if _uses(s) == action]


def _normalise(command: str) -> str:
    return " ".join(command.split())


def _readme_command(word: str) -> str:
    """The one command in the README's bash blocks that mentions `word`."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", readme, re.S)
    lines = [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith("#") and word in line
    ]
    assert len(lines) == 1, f"expected one README command with {word!r}, found {lines}"
    return lines[0]


def _gpu_jobs():
    return [(name, wf, job_id, job) for name, wf, job_id, job in _jobs() if GPU_LABEL in _runs_on(job)]


def _test_jobs():
    """Jobs with a step that runs pytest."""
    return [
        (name, wf, job_id, job)
        for name, wf, job_id, job in _jobs()
        if any("pytest" in (s.get("run") or "") for s in job.get("steps", []))
    ]


def _actionlint() -> str:
    candidate = Path(sys.executable).with_name("actionlint")
    exe = str(candidate) if candidate.exists() else shutil.which("actionlint")
    assert exe, "actionlint is not installed (bash scripts/setup.sh installs requirements.txt)"
    return exe


ACTIONLINT_CONFIG = REPO_ROOT / ".github" / "actionlint.yaml"


def _run_actionlint(files: list[Path], tmp_path: Path) -> subprocess.CompletedProcess:
    """actionlint with the repository's own configuration (as plain `actionlint` would find it)."""
    return subprocess.run(
        [_actionlint(), "-config-file", str(ACTIONLINT_CONFIG), *map(str, files)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )


# --------------------------------------------------------------------------- lint


def test_actionlint_is_clean_with_the_repositorys_config():
    """`actionlint` run bare in the repository, as a contributor would, finds its config (which
    declares the GPU runner's label) and, with shellcheck on the run: scripts, nothing else.
    Everything below is what actionlint cannot know: this project's own rules."""
    assert WORKFLOW_FILES, f"no workflows in {WORKFLOWS_DIR}"
    config = yaml.safe_load(ACTIONLINT_CONFIG.read_text(encoding="utf-8"))
    assert GPU_LABEL in config["self-hosted-runner"]["labels"]
    proc = subprocess.run([_actionlint()], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, f"actionlint:\n{proc.stdout}\n{proc.stderr}"


def test_actionlint_catches_a_broken_workflow(tmp_path: Path):
    """The lint above is not vacuous: a workflow with a typo'd key and a bad expression fails."""
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    step:\n      - run: echo hi\n"
        "  b:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ github.no_such_thing }}\n",
        encoding="utf-8",
    )
    proc = _run_actionlint([bad], tmp_path)
    assert proc.returncode != 0 and "no_such_thing" in proc.stdout and "step" in proc.stdout, proc.stdout


def test_shellcheck_is_clean_on_the_scripts_outside_the_workflows():
    """The shell scripts that no workflow holds (CI's entry point, the setup, the GPU machine's
    checks) pass shellcheck as the workflows' run: steps do."""
    scripts = [REPO_ROOT / ".ci" / "run", *sorted((REPO_ROOT / "scripts").glob("*.sh"))]
    assert len(scripts) >= 4, scripts
    candidate = Path(sys.executable).with_name("shellcheck")
    exe = str(candidate) if candidate.exists() else shutil.which("shellcheck")
    assert exe, "shellcheck is not installed (bash scripts/setup.sh installs requirements.txt)"
    proc = subprocess.run([exe, *map(str, scripts)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, f"shellcheck:\n{proc.stdout}\n{proc.stderr}"


# --------------------------------------------------------------------------- every job


def test_every_run_step_is_bash_that_stops_at_the_first_error():
    bad = []
    for name, wf, job_id, job in _jobs():
        for i, step in enumerate(job.get("steps", [])):
            if "run" in step and not _stops_at_first_error(_shell(wf, job, step)):
                bad.append(
                    f"{name}:{job_id} step {i} ({step.get('name', step['run'][:40])!r}): "
                    f"shell {_shell(wf, job, step)!r}"
                )
    assert not bad, "run steps must use `shell: bash -eo pipefail {0}` (e.g. via defaults.run.shell):\n" + "\n".join(
        bad
    )


def test_every_action_is_pinned_to_a_commit():
    bad = []
    for name, _, job_id, job in _jobs():
        for step in job.get("steps", []):
            uses = step.get("uses")
            if (
                uses
                and not uses.startswith(("./", "docker://"))
                and not re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", uses)
            ):
                bad.append(f"{name}:{job_id}: {uses}")
    assert not bad, "pin actions to a full commit SHA (with the tag in a comment):\n" + "\n".join(bad)


def test_every_job_has_a_timeout():
    missing = [f"{name}:{job_id}" for name, _, job_id, job in _jobs() if "timeout-minutes" not in job]
    assert not missing, f"jobs without timeout-minutes: {missing}"


# --------------------------------------------------------------------------- tests on CPU and GPU


def test_cpu_job_runs_exactly_the_readme_test_command():
    command = _readme_command("pytest")
    cpu = [(n, wf, j, job) for n, wf, j, job in _test_jobs() if _runs_on(job) == ["ubuntu-latest"]]
    assert len(cpu) == 1, f"expected one ubuntu-latest job running pytest, found {[(n, j) for n, _, j, _ in cpu]}"
    name, wf, job_id, job = cpu[0]
    runs = [s["run"] for s in job["steps"] if "pytest" in (s.get("run") or "")]
    assert [_normalise(r) for r in runs] == [command], f"{name}:{job_id} runs {runs}, README says {command!r}"
    assert DEVICE_ENV not in _env(wf, job), f"{name}:{job_id}: the CPU job must not force a device"
    setup = _steps_using(job, "actions/setup-python")
    assert setup, f"{name}:{job_id}: no actions/setup-python step"
    with_ = setup[0].get("with") or {}
    assert str(with_.get("python-version")) == "3.11", f"{name}:{job_id}: pin python-version '3.11', not {with_}"
    assert with_.get("cache") == "pip", f"{name}:{job_id}: actions/setup-python needs `cache: pip`"


def test_gpu_job_runs_nvidia_smi_first_then_the_readme_command_on_cuda():
    command = _readme_command("pytest")
    gpu = [(n, wf, j, job) for n, wf, j, job in _test_jobs() if GPU_LABEL in _runs_on(job)]
    assert len(gpu) == 1, f"expected one job running pytest on the {GPU_RUNS_ON} runner, found {len(gpu)}"
    name, wf, job_id, job = gpu[0]
    steps = job["steps"]
    test_index = next(i for i, s in enumerate(steps) if "pytest" in (s.get("run") or ""))
    assert _normalise(steps[test_index]["run"]) == command, f"{name}:{job_id}: runs {steps[test_index]['run']!r}"
    assert _env(wf, job, steps[test_index]).get(DEVICE_ENV) == "cuda", (
        f"{name}:{job_id}: the tests must run with {DEVICE_ENV}=cuda"
    )


def test_gpu_jobs_use_the_self_hosted_label_and_check_the_gpu_first():
    jobs = _gpu_jobs()
    assert len(jobs) >= 2, "expected the GPU test job and the weekly Colab job on the GPU runner"
    for name, _wf, job_id, job in jobs:
        assert _runs_on(job) == GPU_RUNS_ON, f"{name}:{job_id}: runs-on {_runs_on(job)}, expected {GPU_RUNS_ON}"
        first = job["steps"][0]
        assert _normalise(first.get("run") or "") == "nvidia-smi", (
            f"{name}:{job_id}: the first step must be `run: nvidia-smi`, not {first}"
        )


# --------------------------------------------------------------------------- the book


def _deploy_jobs():
    return [(n, wf, j, job) for n, wf, j, job in _jobs() if _steps_using(job, "actions/deploy-pages")]


def test_book_job_builds_with_the_readme_command_and_keeps_failure_reports():
    build_command = _readme_command("jupyter-book")
    assert f"jupyter-book {' '.join(BUILD_ARGS)} ." in build_command, build_command
    builders = [
        (n, wf, j, job)
        for n, wf, j, job in _jobs()
        if any("jupyter-book build" in (s.get("run") or "") for s in job.get("steps", []))
    ]
    assert len(builders) == 1, f"expected one job that builds the book, found {[(n, j) for n, _, j, _ in builders]}"
    name, wf, job_id, job = builders[0]
    runs = [_normalise(s["run"]) for s in job["steps"] if "jupyter-book build" in (s.get("run") or "")]
    assert runs == [build_command], f"{name}:{job_id} builds with {runs}, README says {build_command!r}"
    reports = _steps_using(job, "actions/upload-artifact")
    assert any(
        s.get("if") == "failure()" and (s.get("with") or {}).get("path") == "_build/html/reports" for s in reports
    ), f"{name}:{job_id}: upload _build/html/reports with `if: failure()`"
    pages = _steps_using(job, "actions/upload-pages-artifact")
    assert len(pages) == 1 and (pages[0].get("with") or {}).get("path") == "_build/html", (
        f"{name}:{job_id}: upload _build/html with actions/upload-pages-artifact"
    )
    assert MAIN_REF in _normalise(pages[0].get("if", "")), f"{name}:{job_id}: upload the site only from main"


def test_deploy_job_deploys_only_from_main():
    deploy = _deploy_jobs()
    assert len(deploy) == 1, "expected one job with actions/deploy-pages"
    name, wf, job_id, job = deploy[0]
    condition = _normalise(str(job.get("if", "")))
    assert MAIN_REF in condition and "||" not in condition, (
        f"{name}:{job_id}: `if:` must require {MAIN_REF} (and nothing that widens it): {condition!r}"
    )
    assert "github.event_name != 'pull_request'" in condition, f"{name}:{job_id}: never deploy from a pull request"
    assert job.get("permissions") == {"pages": "write", "id-token": "write"}, job.get("permissions")
    assert (job.get("environment") or {}).get("name") == "github-pages", job.get("environment")
    assert job.get("needs") in ("build", ["build"]), job.get("needs")
    pushes = (wf["on"].get("push") or {}).get("branches")
    assert pushes == ["main"], f"{name}: push trigger should be limited to main, not {pushes}"


# --------------------------------------------------------------------------- weekly Colab


def test_weekly_job_executes_the_chapters_in_colabs_runtime_on_the_gpu():
    scheduled = {n: wf for n, wf in WORKFLOWS.items() if isinstance(wf["on"], dict) and "schedule" in wf["on"]}
    assert len(scheduled) == 1, f"expected one scheduled workflow, found {sorted(scheduled)}"
    name, wf = next(iter(scheduled.items()))
    crons = [entry["cron"] for entry in wf["on"]["schedule"]]
    assert crons and all(len(c.split()) == 5 for c in crons), crons
    day_of_week = crons[0].split()[4]
    assert crons[0].split()[2] == "*" and re.fullmatch(r"[0-6]", day_of_week), f"{name}: not weekly: {crons}"
    jobs = wf["jobs"]
    assert len(jobs) == 1, f"{name}: expected one job"
    job_id, job = next(iter(jobs.items()))
    assert _runs_on(job) == GPU_RUNS_ON
    text = "\n".join(s.get("run") or "" for s in job["steps"])
    image = _env(wf, job).get("COLAB_IMAGE", "")
    assert image.split(":")[0] == COLAB_IMAGE or COLAB_IMAGE in text, f"{name}: does not use {COLAB_IMAGE}"
    joined = text.replace("\\\n", " ")  # shell line continuations
    docker = re.findall(r"docker run\b[^\n]*", joined)
    assert docker and all("--gpus all" in d for d in docker), f"{name}: `docker run --gpus all` expected:\n{docker}"
    assert f"{DEVICE_ENV}=cuda" in text, f"{name}: the container must force {DEVICE_ENV}=cuda"
    assert re.search(r"pip install\b[^\n]*/tmp/book-checkout", text), f"{name}: install the package from the checkout"
    assert "benchmarks/bench_chapters.py" in text, f"{name}: execute every chapter (benchmarks/bench_chapters.py)"


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_workflow_can_be_run_by_hand(name):
    assert "workflow_dispatch" in (WORKFLOWS[name]["on"] or {}), f"{name}: add `workflow_dispatch:`"


def test_readme_python_examples_run():
    """The README's Python blocks run as printed, in one namespace (the compile block last: it
    wraps the model the others build, and compiles nothing until the model is called)."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) >= 3
    ordered = [b for b in blocks if "compile_model" not in b] + [b for b in blocks if "compile_model" in b]
    namespace: dict = {}
    for block in ordered:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    trained = namespace["trained"]
    dates = [trained.task.to_iso(row) for row in namespace["ids"]]
    assert len(dates) == 3 and all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", d) for d in dates), dates
    assert namespace["logits"].shape == (2, 10, 11)
