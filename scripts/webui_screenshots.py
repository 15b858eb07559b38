"""Screenshots of the playground for the docs: starts `llmserve serve` on the default model, has one greedy chat
turn in headless Chromium, and saves the page at a desktop and a phone width.

    .venv/bin/python scripts/webui_screenshots.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

PROMPT = "Write a Python function that reverses a string, in a code block, then explain it in two sentences."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = ap.parse_args()
    if not args.chromium:
        sys.exit("webui_screenshots: no chromium found; install it or pass --chromium PATH")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", "--port", str(port), "--dtype", "float32"],
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 820})
            page.goto(base + "/")
            page.wait_for_function("() => document.querySelector('#model').value !== ''")
            page.fill("#system", "You are a concise programming assistant.")
            page.fill("#settings-form [name=temperature]", "0")
            page.fill("#settings-form [name=max_tokens]", "160")
            page.fill("#prompt", PROMPT)
            page.keyboard.press("Enter")
            page.wait_for_selector("#messages li.message.assistant:not(.pending)", timeout=300_000)
            page.wait_for_timeout(2500)  # one /metrics poll after the answer
            page.evaluate("() => { document.querySelector('#messages').scrollTop = 0; }")
            page.screenshot(path=str(out / "playground-desktop.png"))
            page.set_viewport_size({"width": 390, "height": 844})
            page.wait_for_timeout(300)
            page.evaluate("() => { document.querySelector('#messages').scrollTop = 0; }")
            page.screenshot(path=str(out / "playground-narrow.png"))
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=15)
    print(f"wrote {out / 'playground-desktop.png'} and {out / 'playground-narrow.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
