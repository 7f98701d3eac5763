"""The chat page in headless Chromium: send a message, watch the reply stream in, press stop."""

import os
import shutil
import time

import pytest

ARTIFACTS = os.path.join(os.path.dirname(__file__), "artifacts")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_chat_page_streams_and_stops(server):
    sync_api = pytest.importorskip("playwright.sync_api")
    os.makedirs(ARTIFACTS, exist_ok=True)
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.goto(server.url + "/")
            page.fill("#max_tokens", "400")
            page.fill("#input", "Write a long story about a dragon who learns to bake bread.")
            page.click("#send")
            reply = page.locator(".msg.assistant").last
            # Streamed: the text grows while the stop button is live.
            page.wait_for_function("document.querySelector('.msg.assistant').textContent.length > 20",
                                   timeout=60000)
            first_len = len(reply.text_content())
            time.sleep(0.5)
            assert page.is_enabled("#stop")
            grown = len(reply.text_content())
            assert grown >= first_len
            page.click("#stop")
            page.wait_for_function("!document.querySelector('#send').disabled", timeout=10000)
            stopped_len = len(reply.text_content())
            time.sleep(1.0)
            assert len(reply.text_content()) == stopped_len  # nothing arrives after stop
            assert "tokens/s" in page.text_content("#stats")
            page.screenshot(path=os.path.join(ARTIFACTS, "chat_page.png"))
        finally:
            browser.close()
    server.wait_idle(timeout=30)
