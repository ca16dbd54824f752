"""Flower as users see it: a real ``celery flower`` against a worker that skipped runs, its tasks
page and each skipped task's page opened in headless Chromium (Debian's ``chromium``, driven by
Playwright); the skipped runs are shown with their state and reason. Screenshots are kept under
the test's output directory (pytest's ``tmp_path``, printed with ``-s``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis

from .celery_app import make_app
from .celery_support import WorkerProcess, wait_for_body
from .servers import free_port

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("TASKGUARD_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def test_flower_tasks_page_shows_skipped_runs_with_state_and_reason(redis_url, prefix, tmp_path):
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), (
        "Debian's chromium is needed: ./run test installs it where "
        "apt-get is usable; else install it or set TASKGUARD_CHROMIUM"
    )
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    port = free_port()
    env = {**os.environ, "TG_TEST_QUEUE": queue, "TG_TEST_PREFIX": prefix}
    log_path = tmp_path / "flower.log"
    log = open(log_path, "wb")
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.celery_app", "flower", f"--port={port}", "--address=127.0.0.1"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    shot = tmp_path / "flower-tasks.png"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        with WorkerProcess(queue, prefix, concurrency=3, extra=("-E",)):
            time.sleep(2.0)
            first = app.tasks["tg.slow"].apply_async((1,), {"seconds": 3.0})
            wait_for_body(app, "slow:1:start")
            as_result = app.tasks["tg.slow"].apply_async((1,), {"seconds": 0})  # on_skip="result"
            holder = app.tasks["tg.on_skip_ignore"].apply_async((), {"seconds": 3.0})
            wait_for_body(app, "ignore:0:ran")
            ignored = app.tasks["tg.on_skip_ignore"].apply_async((), {"seconds": 0})  # on_skip="ignore"
            first.get(timeout=15), as_result.get(timeout=15), holder.get(timeout=15)
            time.sleep(2.0)  # Flower takes the events in
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"]
                )
                page = browser.new_page(viewport={"width": 1600, "height": 900})
                page.goto(f"http://127.0.0.1:{port}/tasks", wait_until="networkidle")
                page.wait_for_selector(f"text={as_result.id}", timeout=15000)
                page.wait_for_selector(f"text={ignored.id}", timeout=15000)
                rows = {}
                for uid in (as_result.id, ignored.id, first.id):
                    rows[uid] = page.locator("tr", has_text=uid).first.inner_text()
                page.screenshot(path=str(shot), full_page=True)
                details = {}
                for uid in (as_result.id, ignored.id):
                    page.goto(f"http://127.0.0.1:{port}/task/{uid}", wait_until="networkidle")
                    details[uid] = page.inner_text("body")
                    page.screenshot(path=str(tmp_path / f"flower-task-{uid[:8]}.png"), full_page=True)
                browser.close()
    finally:
        flower.terminate()
        flower.wait(15)
        log.close()
        redis.Redis.from_url(redis_url).delete(app.tg_log, queue)
    print(f"    screenshot: {shot}")
    for uid, text in rows.items():
        print(f"    row {uid[:8]}: {' '.join(text.split())[:200]}")
    for uid, text in details.items():
        print(f"    page of {uid[:8]}: {' '.join(text.split())[:1500]}")
    # the tasks list: on_skip="result" ends SUCCESS (the succeeded event outranks task-skipped);
    # on_skip="ignore" shows the task-skipped state itself
    assert "SUCCESS" in rows[as_result.id] and "SKIPPED" in rows[ignored.id] and "SUCCESS" in rows[first.id]
    # each task's page says why: the readable result (the plain tagged dict) or the event's line
    page = " ".join(details[as_result.id].split())
    assert "Status SUCCESS" in page and "'reason': 'held'" in page and "'key': 'slow:1'" in page
    page = " ".join(details[ignored.id].split())
    assert "Status SKIPPED" in page and "skipped, lease 'modes' held" in page
    assert shot.stat().st_size > 10_000
