"""The web page (GET /) in headless Chromium, driven by selenium: type a prompt, press Generate, and watch the
text arrive piece by piece (the fake engine's decode steps are released one at a time by the test)."""
import shutil
import tempfile

import pytest

CHROMIUM, DRIVER = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver")
if not (shutil.os.path.exists(CHROMIUM) and DRIVER):
    pytest.skip("headless Chromium not installed (apt-get install -y chromium chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from opt_serving.engine.scheduler import Engine  # noqa: E402
from opt_serving.text.generator import Generator  # noqa: E402
from opt_serving.service.app import create_app  # noqa: E402
from opt_serving.service.testserver import serve_in_thread  # noqa: E402
from opt_serving.engine.fake import GatedSlots  # noqa: E402
from opt_serving.text.fake import byte_tokenizer  # noqa: E402


@pytest.fixture
def browser():
    profile = tempfile.mkdtemp(prefix="opt-serving-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser):
    """The page served over the gated fake engine, loaded: (slots, generator, wait). The test releases
    each decode step through `slots.gate`."""
    slots = GatedSlots(num_slots=2, max_seq_len=64)
    g = Generator(Engine(slots, max_queue=4), byte_tokenizer(), model_name="opt-fake")
    try:
        with serve_in_thread(create_app(g)) as url:
            browser.get(url + "/")
            yield slots, g, WebDriverWait(browser, 30)
    finally:
        for _ in range(30):  # no step left waiting at the gate, so the engine can close
            slots.gate.release()
        g.close()


def test_page_streams_the_completion(browser, page):
    slots, _, wait = page
    wait.until(lambda d: d.find_element(By.ID, "model").text == "opt-fake")
    for field, value in (("prompt", "a"), ("max_tokens", "4"), ("temperature", "0")):
        el = browser.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    browser.find_element(By.ID, "generate").click()

    def completion(d):
        return d.find_element(By.ID, "completion").text
    # the first token comes from the prefill; no decode step has run yet
    wait.until(lambda d: completion(d) == "b")
    assert browser.find_element(By.ID, "status").text.startswith("generating")
    slots.gate.release()
    wait.until(lambda d: completion(d) == "bc")
    for _ in range(2):
        slots.gate.release()
    wait.until(lambda d: d.find_element(By.ID, "status").text == "done (length)")
    assert completion(browser) == "bcde"
    assert browser.find_element(By.CSS_SELECTOR, "#output .prompt").text == "a"


def test_page_shows_errors_and_stops(browser, page):
    slots, g, wait = page
    wait.until(lambda d: d.find_element(By.ID, "context").text == "(context: 64 tokens)")
    tokens = browser.find_element(By.ID, "max_tokens")
    tokens.clear()
    tokens.send_keys("100")  # the default prompt + 100 tokens do not fit in 64
    browser.find_element(By.ID, "generate").click()
    status = browser.find_element(By.ID, "status")
    wait.until(lambda d: status.text.startswith("error"))
    assert "maximum context length is 64 tokens" in status.text
    assert status.value_of_css_property("color") == "rgba(176, 0, 32, 1)"  # shown as an error
    # Stop during a stream: the request ends and its engine slot is freed
    tokens.clear()
    tokens.send_keys("20")
    browser.find_element(By.ID, "generate").click()
    wait.until(lambda d: d.find_element(By.ID, "completion").text != "")
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda d: status.text == "stopped")
    assert status.value_of_css_property("color") != "rgba(176, 0, 32, 1)"
    # The page has stopped, but the server may see the closed stream a moment later: a step let through
    # before then delivers a token and the engine blocks in the next one. Let steps through until the
    # engine has seen the cancellation and freed the slot.
    def slot_freed(_):
        slots.gate.release()
        return g.stats()["running"] == 0
    wait.until(slot_freed)
    assert browser.find_element(By.ID, "generate").is_enabled()
