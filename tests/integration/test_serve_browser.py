"""The web page of `transformer serve` in headless Chromium: type, click, read, look.

Needs Playwright (PyPI `playwright`, in the dev extra) and a system Chromium (Debian:
`apt-get install chromium`, which scripts/test.sh does); skips without either, and fails under
CI=true (tests/conftest.py). The screenshot goes to the test's
tmp dir, or to $SERVE_SCREENSHOT_DIR when set (to look at it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fixtures import make_model_file, running_server

pytestmark = pytest.mark.integration

sync_api = pytest.importorskip("playwright.sync_api")
httpx = pytest.importorskip("httpx2")  # starlette's recommended client
pytest.importorskip("uvicorn")

SENTENCE = "A man in an orange hat starring at something."


def _chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        path = name and shutil.which(name)
        if path:
            return path
    pytest.skip("no system chromium (apt-get install chromium)")


def _colored_pixels(page) -> int:
    """Heatmap cells drawn on the canvas: pixels that are neither white nor near-white."""
    return page.evaluate(
        """() => {
        const c = document.getElementById("heatmap");
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i] < 200 && d[i + 2] > d[i]) n++;
        return n;
    }"""
    )


def test_type_click_read_translation_and_attention(tmp_path):
    chromium = _chromium()
    model = make_model_file(tmp_path / "model")
    shots = Path(os.environ.get("SERVE_SCREENSHOT_DIR", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    with running_server(model) as url, sync_api.sync_playwright() as p:
        expected = httpx.post(f"{url}/v1/translate", json={"text": SENTENCE}, timeout=60).json()
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1000})
            page.goto(url)
            page.wait_for_function(
                "document.getElementById('model-info').textContent.includes('→')"
            )
            page.fill("#source", SENTENCE)
            page.click("#translate")
            page.wait_for_selector("#output .translation")
            shown = page.inner_text("#output .translation")
            assert shown == expected["results"][0]["translations"][0]["text"].strip()
            page.wait_for_selector("#attention-panel:not([hidden])")
            assert _colored_pixels(page) > 100
            layers = page.eval_on_selector_all("#layer option", "os => os.length")
            assert layers == 2  # the tiny model's N
            page.select_option("#kind", "encoder")
            page.select_option("#head", "2")
            assert _colored_pixels(page) > 100
            page.select_option("#kind", "cross")
            page.select_option("#head", "mean")
            shot = shots / "serve_page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            page.fill("#source", "")
            page.click("#translate")
            assert "Type a sentence" in page.inner_text("#error")
        finally:
            browser.close()
