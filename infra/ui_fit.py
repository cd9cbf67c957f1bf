"""Do a Prefect server's markdown and table artifacts fit the page in both of its UIs? Opens the
newest artifact of each key in headless Chromium at 1440 x 900, in the V1 UI and the V2 UI, and
prints each table, code block or inline path wider than the box it sits in (Prefect's V1 UI does
not wrap a table's cells); exits 1 if any is. Screenshots go to the folder given.

Not part of the suite (it needs a browser): Debian's chromium and playwright in a venv of their own,
    apt-get install chromium && python -m venv /tmp/pw && /tmp/pw/bin/pip install playwright
    /tmp/pw/bin/python infra/ui_fit.py http://127.0.0.1:4200 /tmp/shots
against a server started with PREFECT_UI_API_URL set to its API, after a `precast run`."""

import json
import sys
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

WIDER = """() => { const out = [];
  for (const e of document.querySelectorAll('table, pre, p > code, li > code')) {
    const box = (e.parentElement.closest('.markdown-body, .prose, article, main') || document.body).getBoundingClientRect();
    const r = e.getBoundingClientRect();
    if (r.right > box.right + 1 || e.scrollWidth > e.clientWidth + 1)
      out.push(`${e.tagName} ends at ${Math.round(r.right)} px, its box at ${Math.round(box.right)}: `
               + (e.innerText || '').replace(/\\s+/g, ' ').slice(0, 70)); }
  return out; }"""


def main(server: str, shots: Path) -> int:
    shots.mkdir(parents=True, exist_ok=True)
    request = urllib.request.Request(f"{server}/api/artifacts/filter", data=b"{}",
                                     headers={"content-type": "application/json"})
    artifacts = sorted((a for a in json.load(urllib.request.urlopen(request)) if a["type"] in ("markdown", "table")),
                       key=lambda a: a["created"])
    newest = {a["key"]: a for a in artifacts}.values()
    wide = 0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        for ui in ("", "/v2"):
            for artifact in newest:
                page.goto(f"{server}{ui}/artifacts/artifact/{artifact['id']}", wait_until="networkidle")
                page.wait_for_timeout(1500)
                found = page.evaluate(WIDER)
                wide += len(found)
                print(f"{ui.strip('/') or 'v1'} {artifact['key']}: " + ("fits" if not found else "; ".join(found)))
                page.screenshot(path=str(shots / f"{ui.strip('/') or 'v1'}-{artifact['key']}.png"), full_page=True)
        browser.close()
    return 1 if wide else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1].rstrip("/"), Path(sys.argv[2])))
