"""`make lab` serves the course: JupyterLab opens notebook 00 in a real headless Chromium and runs it.

Needs Debian's `chromium` (apt-get install chromium) and the `playwright` Python package (in the
course environment). Without Chromium the test is skipped with that hint, except in CI (CI=true),
where it must run. The server gets a copy of the notebooks, so nothing is saved into notebooks/.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.browser


def _require_browser():
    if CHROMIUM is None:
        msg = "no Chromium: install it to run this test (Debian/Ubuntu: sudo apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return pytest.importorskip("playwright.sync_api", reason="pip install playwright (in `make setup`)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lab_settings(folder: Path):
    """JupyterLab settings for a repeatable run: no autosave, no news, every cell kept in the page."""
    settings = {
        "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for name, value in settings.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


@contextlib.contextmanager
def _make_lab(tmp_path, *make_args):
    """Run `make lab` with `make_args` on a free port; yield the server's base URL, stop it afterwards."""
    _lab_settings(tmp_path / "settings")
    port = _free_port()
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
    )
    lab_args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token= --ServerApp.password="
    server = subprocess.Popen(
        ["make", "-s", "lab", f"PYTHON={sys.executable}", f"LAB_ARGS={lab_args}", *make_args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status", timeout=2)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    pytest.fail(
                        f"`make lab {' '.join(make_args)}` did not serve:\n{server.stdout.read1().decode()}"
                    )
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def _open_notebook(sync_api, p, url, viewport=(1400, 1000)):
    """A headless Chromium page on `url` (a window of `viewport` pixels), the kernel idle and chosen;
    returns (browser, page)."""
    browser = p.chromium.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    )  # fmt: skip
    page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
    page.goto(url)
    # after ?reset JupyterLab may ask which kernel to use (the notebook names python3): wait for whichever comes first,
    # the notebook's kernel connected and idle (the indicator reads idle before, with "No Kernel") or that question
    # (a fixed 5 s wait for a question that did not come cost each test 5 s)
    page.wait_for_function(f"() => ({_KERNEL_READY})() || ({_ASKS_KERNEL})()", timeout=90_000)
    select = page.get_by_role("button", name="Select", exact=True)
    if select.is_visible():
        select.click()
        page.wait_for_function(_KERNEL_READY, timeout=90_000)
    return browser, page


_KERNEL_READY = """() => {
    const name = document.querySelector('.jp-KernelName'),
          status = document.querySelector('.jp-Notebook-ExecutionIndicator');
    return !!name && !!status && !name.textContent.includes('No Kernel')
        && status.getAttribute('data-status') === 'idle';
}"""
_ASKS_KERNEL = (
    "() => [...document.querySelectorAll('.jp-Dialog button')].some(b => b.textContent.trim() === 'Select')"
)


def test_make_lab_student_shows_a_friendly_check_message(tmp_path):
    """`make lab EDITION=student` serves the student edition (only .ipynb files, beside the hidden copy of the
    edition it was built from that `make student` compares with); an unsolved exercise's
    check shows the short message of course_lib.exercises, with no traceback into course_lib."""
    sync_api = _require_browser()
    student = tmp_path / "student"
    with _make_lab(tmp_path, "EDITION=student", f"STUDENT={student}") as base:
        # .pristine (hidden) is the copy of the edition that `make student` compares a rebuild with
        visible = [p for p in student.iterdir() if not p.name.startswith(".")]
        assert sorted(p.suffix for p in visible) == [".ipynb"] * len(visible)
        listing = json.loads(urllib.request.urlopen(f"{base}/api/contents/").read())
        names = [item["name"] for item in listing["content"]]
        assert "00_setup.ipynb" in names and not any(n.endswith(".py") for n in names), names
        shots = ROOT / "build" / "browser"
        shots.mkdir(parents=True, exist_ok=True)
        with sync_api.sync_playwright() as p:
            browser, page = _open_notebook(sync_api, p, f"{base}/lab/tree/00_setup.ipynb?reset")
            try:
                page.get_by_role("menuitem", name="Run", exact=True).click()
                page.get_by_text("Run All Cells", exact=True).click()
                outputs = page.locator(".jp-OutputArea-output")
                message = outputs.filter(has_text="Exercise 'score matrix bytes' is not done yet")
                sync_api.expect(message).to_have_count(1, timeout=120_000)
                text = message.inner_text()
            finally:
                page.screenshot(path=str(shots / "00_setup_student.png"), full_page=False)
                browser.close()
        assert "replace the `raise NotImplementedError`" in text, text
        assert "Traceback" not in text and "course_lib/exercises.py" not in text, text
        assert not list(student.glob("*.py")), "saving in the student edition wrote a paired .py file"


def test_make_lab_runs_notebook_00_in_chromium(tmp_path):
    sync_api = _require_browser()
    nb_dir = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", nb_dir, ignore=shutil.ignore_patterns("*.py", ".ipynb_checkpoints"))
    shots = ROOT / "build" / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    with _make_lab(tmp_path, f"NOTEBOOK_DIR={nb_dir}") as base, sync_api.sync_playwright() as p:
        browser, page = _open_notebook(sync_api, p, f"{base}/lab/tree/00_setup.ipynb?reset")
        try:
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_text("Run All Cells", exact=True).click()
            outputs = page.locator(".jp-OutputArea-output")
            sync_api.expect(outputs.filter(has_text="All good: the course runs here.")).to_have_count(
                1, timeout=120_000
            )
            sync_api.expect(outputs.filter(has_text="Exercise 'score matrix bytes': correct.")).to_have_count(
                1, timeout=120_000
            )
            sync_api.expect(page.locator(".jp-OutputArea-output img").first).to_be_visible(timeout=60_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            text = page.locator(".jp-Notebook").inner_text()
        finally:
            page.screenshot(path=str(shots / "00_setup.png"), full_page=False)  # kept for a human to look at
            browser.close()
    assert "Traceback" not in text, "a cell raised in the browser: " + text[text.find("Traceback") :][:800]


def _instructor_cell(notebook: str, marker: str) -> str:
    """The source of the instructor edition's code cell of `notebook` that contains `marker`."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / notebook, as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and marker in c.source)


def _shots():
    """The folder of screenshots kept for a human to look at."""
    shots = ROOT / "build" / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    return shots


def test_student_solves_the_softmax_kernel_in_the_browser(tmp_path):
    """A learner's path through notebook 05's kernel exercise, in the student edition at a laptop's 1366 x 768:
    the exercise cell's `raise NotImplementedError` is replaced, in the browser's editor, by the instructor's
    kernel body; the cells up to the check run, and the check says the kernel is correct."""
    sync_api = _require_browser()
    student = tmp_path / "student"
    answer = _instructor_cell("05_triton_primer.ipynb", "def softmax_kernel(")
    markers = ("### BEGIN SOLUTION", "### END SOLUTION")
    assert all(m in answer for m in markers)
    answer = "\n".join(line for line in answer.splitlines() if line.strip() not in markers)  # as typed
    # notebook 05's student edition only: writing all of them would take most of this test's time
    subprocess.run(
        [sys.executable, "-m", "course_lib.tools.notebooks", "student", str(student), "05"],
        cwd=ROOT,
        check=True,
    )
    with _make_lab(tmp_path, f"NOTEBOOK_DIR={student}") as base:
        with sync_api.sync_playwright() as p:
            url = f"{base}/lab/tree/05_triton_primer.ipynb?reset"
            browser, page = _open_notebook(sync_api, p, url, viewport=(1366, 768))
            try:
                cells = page.locator(".jp-Notebook .jp-Cell")
                exercise = cells.filter(has_text="def softmax_kernel(")
                sync_api.expect(exercise).to_have_count(1)
                editor = exercise.locator(".cm-content")
                assert "raise NotImplementedError" in editor.inner_text()
                editor.click()  # edit mode in the exercise cell
                page.keyboard.press("Control+a")  # the cell's whole text (CodeMirror selects within the cell)
                page.keyboard.insert_text(answer)  # as a paste: no auto-indent, no closing brackets added
                typed = editor.inner_text()
                assert "raise NotImplementedError" not in typed and "tl.sum(numerator, axis=0)" in typed, (
                    typed
                )
                page.keyboard.press("Escape")  # command mode
                # the cell after the check: run everything above it (the exercise and its check included)
                after_check = cells.filter(has_text="From here on, course_lib's finished kernel")
                after_check.click()
                page.get_by_role("menuitem", name="Run", exact=True).click()
                page.get_by_text("Run All Above Selected Cell", exact=True).click()
                outputs = page.locator(".jp-OutputArea-output")
                verdict = outputs.filter(has_text="Exercise 'softmax_kernel'")
                sync_api.expect(verdict).to_have_count(1, timeout=120_000)
                text = verdict.inner_text()
            finally:
                page.screenshot(path=str(_shots() / "05_student_softmax.png"), full_page=False)
                browser.close()
    assert "Exercise 'softmax_kernel': correct on all" in text, text


def test_widest_figures_show_unshrunk_at_1366x768(tmp_path, monkeypatch):
    """At a laptop's 1366 x 768, with JupyterLab's default layout (file browser open), course_lib's widest
    figure (an animation strip, `animate.WIDTH` inches) and a figure at the readable-figure rule's limit
    (`plotting.COLUMN_PX` as displayed) show at their natural width inside the output column: JupyterLab
    does not shrink them, or their text. The column itself is COLUMN_PX wide. The kernel runs with
    COURSE_STRICT_FIGURES=1, so a figure over the rule would show an error instead."""
    import nbformat

    sync_api = _require_browser()
    monkeypatch.setenv("COURSE_STRICT_FIGURES", "1")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import matplotlib.pyplot as plt\nimport torch\n"
            "from course_lib.attention import animate\nfrom course_lib.perf import plotting\n"
            "torch.manual_seed(0)\nq, k, v = torch.randn(3, 16, 8).unbind(0)\n"
            "frames = {o: animate.forward_frames(q, k, v, 4, 4, causal=True, order=o) for o in ('fa1', 'fa2')}\n"
            "animate.forward_strip(frames)\nplt.show()"
        ),
        nbformat.v4.new_code_cell(  # as wide as the rule allows: its PNG a few pixels under COLUMN_PX
            "fig, ax = plt.subplots(figsize=(plotting.COLUMN_PX / 100 - 0.15, 2.5), layout='constrained')\n"
            "ax.plot([0, 1], [0, 1], label='a line')\nax.legend()\n"
            "ax.set_title('At the limit: 9 pt text stays 9 pt')\nplt.show()"
        ),
    ]
    nbformat.write(nb, tmp_path / "wide.ipynb")
    with _make_lab(tmp_path, f"NOTEBOOK_DIR={tmp_path}") as base, sync_api.sync_playwright() as p:
        browser, page = _open_notebook(sync_api, p, f"{base}/lab/tree/wide.ipynb?reset", viewport=(1366, 768))
        try:
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_text("Run All Cells", exact=True).click()
            images = page.locator(".jp-OutputArea-output img")
            sync_api.expect(images).to_have_count(2, timeout=120_000)
            page.wait_for_function(
                "() => [...document.querySelectorAll('.jp-OutputArea-output img')]"
                ".every(i => i.complete && i.naturalWidth > 0)",
                timeout=30_000,
            )
            sizes = page.evaluate(
                """() => [...document.querySelectorAll('.jp-OutputArea-output img')].map(img => {
                    const out = img.closest('.jp-OutputArea-output'), r = img.getBoundingClientRect(),
                          o = out.getBoundingClientRect();
                    return {natural: img.naturalWidth, client: img.clientWidth, column: out.clientWidth,
                            right: r.right, columnRight: o.right, dpr: window.devicePixelRatio};
                })"""
            )
            text = page.locator(".jp-Notebook").inner_text()
            images.first.scroll_into_view_if_needed()
        finally:
            page.screenshot(path=str(_shots() / "wide_figure_1366x768.png"), full_page=False)
            browser.close()
    assert "Error" not in text, text[text.find("Error") - 200 :][:1200]
    from course_lib.perf import plotting

    for size in sizes:
        assert size["column"] == plotting.COLUMN_PX, (size, "JupyterLab's column moved: re-measure COLUMN_PX")
        natural = size["natural"] / size["dpr"]  # the PNG's pixels in CSS pixels (1 at a 1366 x 768 screen)
        assert size["client"] >= natural - 0.5, (
            size,
            "shrunk by JupyterLab: narrower than its natural width",
        )
        assert size["right"] <= size["columnRight"] + 0.5 and natural <= size["column"], (
            size,
            "past the column",
        )
    assert sizes[1]["natural"] > plotting.COLUMN_PX - 25, sizes  # the second figure really is at the limit
