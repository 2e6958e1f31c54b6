"""The web chat in a real browser: Playwright driving Debian's chromium.

Screenshots are saved under ``$CHATLANE_TEST_ARTIFACTS``, by default
``test-artifacts/`` in the repository root.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import (
    Browser,
    BrowserContext,
    Page,
    Route,
    async_playwright,
    expect,
)

from chatlane.access import GUESSES
from chatlane.adapters.web_page import AUTH_COOKIE, IDENTITY_COOKIE
from chatlane.config import Config, Secret, ServerConfig
from tests.adapters.test_web import ODD_COMMAND, web_server
from tests.test_access import GUESSER, NEIGHBOUR

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(
    os.environ.get("CHATLANE_TEST_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / "test-artifacts"
)
UI_WAIT = 10_000  # milliseconds


def artifact(name: str) -> str:
    """Where to save the artifact ``name`` (the directory is made if missing)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return str(ARTIFACTS / name)


async def shot(page: Page, name: str) -> None:
    """Save what ``page`` shows as the artifact ``<name>.png``."""
    await page.screenshot(path=artifact(f"{name}.png"))


pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"
)


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield browser
        finally:
            await browser.close()


@pytest.fixture
async def host() -> AsyncIterator[str]:
    async with web_server() as address:
        yield address


class ChatPage:
    """One browser context on the chat page, recording console errors."""

    def __init__(self, context: BrowserContext, page: Page) -> None:
        self.context = context
        self.page = page
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    @classmethod
    async def open(cls, browser: Browser, host: str) -> ChatPage:
        context = await browser.new_context(viewport={"width": 1100, "height": 720})
        chat = cls(context, await context.new_page())
        await chat.page.goto(f"http://{host}/")
        await chat.connected()
        return chat

    async def connected(self) -> None:
        await expect(self.page.locator("#status")).to_have_text("Connected", timeout=UI_WAIT)

    async def browser_id(self) -> str:
        """The id this browser was issued (its cookie holds it with the server's signature)."""
        cookies = await self.context.cookies()
        return next(c["value"] for c in cookies if c["name"] == IDENTITY_COOKIE).partition(".")[0]

    async def say(self, text: str) -> None:
        box = self.page.get_by_role("textbox", name="Message")
        await box.fill(text)
        await box.press("Enter")

    async def sees(self, selector: str, text: str) -> None:
        locator = self.page.locator(selector, has_text=text).last
        await expect(locator).to_be_visible(timeout=UI_WAIT)

    @classmethod
    @contextlib.asynccontextmanager
    async def opened(cls, browser: Browser, host: str) -> AsyncIterator[ChatPage]:
        """The page :meth:`open` gives, closed however the block ends."""
        chat = await cls.open(browser, host)
        try:
            yield chat
        finally:
            await chat.close()

    async def close(self) -> None:
        await self.context.close()


async def test_two_browsers_chat_at_once(browser: Browser, host: str) -> None:
    async with (
        ChatPage.opened(browser, host) as alice,
        ChatPage.opened(browser, host) as bob,
    ):
        alice_id, bob_id = await alice.browser_id(), await bob.browser_id()
        assert alice_id != bob_id
        await asyncio.gather(alice.say("whoami"), bob.say("whoami"))
        await alice.sees(".msg.assistant", f"key=main:web:dm:{alice_id} ")
        await bob.sees(".msg.assistant", f"key=main:web:dm:{bob_id} ")
        await expect(alice.page.locator(".msg", has_text=bob_id)).to_have_count(0)
        await expect(bob.page.locator(".msg", has_text=alice_id)).to_have_count(0)

        await alice.say("sleep 2")
        await alice.sees(".msg.user", "sleep 2")
        await alice.say("after the nap")
        await alice.sees(".system.ack", "Queued for the next turn")
        await shot(alice.page, "web-chat-busy")
        await alice.sees(".msg.assistant", "slept 2")
        await alice.sees(".msg.assistant", "echo: after the nap")

        await bob.say("approve rm -rf x")
        await bob.page.get_by_role("button", name="Approve", exact=True).click(timeout=UI_WAIT)
        await bob.sees(".msg.assistant", "approved: rm -rf x")
        await expect(bob.page.get_by_role("button", name="Approve", exact=True)).to_be_disabled()
        await expect(alice.page.locator(".approval")).to_have_count(0)

        await alice.page.reload()
        await alice.connected()
        await alice.sees(".msg.user", "after the nap")
        await alice.sees(".msg.assistant", "echo: after the nap")
        await alice.sees(".msg.assistant", f"key=main:web:dm:{alice_id} ")
        await shot(alice.page, "web-chat")
        await shot(bob.page, "web-chat-approval")
        assert alice.errors == []
        assert bob.errors == []


async def test_typing_on_never_answers_an_approval_that_appears(
    browser: Browser, host: str
) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        box = page.get_by_role("textbox", name="Message")
        await chat.say("approve rm -rf x")
        await chat.sees(".approval", "rm -rf x")
        await expect(box).to_be_focused()  # the card never takes the keyboard
        await page.keyboard.type("still typing ")  # a space and an Enter land in the box
        await page.keyboard.press("Enter")
        await chat.sees(".msg.user", "still typing")
        approve = page.get_by_role("button", name="Approve", exact=True)
        await expect(approve).to_be_enabled()
        await expect(page.locator(".msg.assistant", has_text="approved")).to_have_count(0)
        await shot(page, "web-approval-typed-past")
        await page.get_by_role("button", name="Deny", exact=True).click(timeout=UI_WAIT)
        await chat.sees(".msg.assistant", "denied: rm -rf x")
        assert chat.errors == []


async def test_an_approval_card_shows_its_command_exactly_as_it_would_run(
    browser: Browser, host: str
) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        await chat.say(f"approve {ODD_COMMAND}")
        command = page.locator(".approval .approval-command")
        await expect(command).to_have_count(1, timeout=UI_WAIT)
        assert await command.text_content() == ODD_COMMAND  # no Markdown, no HTML
        card = page.locator(".approval")
        await expect(card.locator("b, strong, a, em")).to_have_count(0)
        await expect(card.locator(".approval-reason")).not_to_be_empty()
        await shot(page, "web-approval-odd-command")
        await page.get_by_role("button", name="Deny", exact=True).click(timeout=UI_WAIT)
        await chat.sees(".msg.assistant", "denied")
        assert chat.errors == []


async def test_a_waiting_approval_survives_a_reload(browser: Browser, host: str) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        await chat.say("approve rm -rf build")
        await chat.sees(".approval", "rm -rf build")
        await page.reload()
        await chat.connected()
        await chat.sees(".msg.user", "approve rm -rf build")
        await chat.sees(".approval", "rm -rf build")
        await shot(page, "web-approval-reloaded")
        await page.get_by_role("button", name="Approve", exact=True).click(timeout=UI_WAIT)
        await chat.sees(".msg.assistant", "approved: rm -rf build")
        await expect(page.get_by_role("button", name="Approve", exact=True)).to_be_disabled()
        await page.reload()
        await chat.connected()
        await chat.sees(".msg.assistant", "approved: rm -rf build")
        await expect(page.locator(".approval")).to_have_count(0)
        said = page.locator(".msg.user", has_text="approve rm -rf build")
        await expect(said).to_have_count(1)
        await shot(page, "web-approval-answered-reloaded")
        assert chat.errors == []


async def test_command_help_and_conversations(browser: Browser, host: str) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        await chat.say("first conversation")
        await chat.sees(".msg.assistant", "echo: first conversation")
        await page.get_by_role("textbox", name="Message").fill("/")
        options = page.get_by_role("option")
        await expect(options.filter(has_text="/approve")).to_be_visible(timeout=UI_WAIT)
        await shot(page, "web-chat-commands")
        await page.get_by_role("textbox", name="Message").press_sequentially("resu")
        await expect(options).to_have_count(1)
        await page.get_by_role("textbox", name="Message").press("Tab")
        await expect(page.get_by_role("textbox", name="Message")).to_have_value("/resume ")
        await page.get_by_role("textbox", name="Message").fill("")

        await page.get_by_role("button", name="New conversation").click()
        await chat.sees(".msg.command", "Started a new conversation")
        await expect(page.locator(".msg.user")).to_have_count(0)
        items = page.locator("#conversations button")
        await expect(items).to_have_count(2, timeout=UI_WAIT)
        await items.filter(has_text="first conversation").click()
        await chat.sees(".msg.user", "first conversation")
        await expect(page.locator("#conversations button[aria-current=true]")).to_contain_text(
            "first conversation"
        )
        assert chat.errors == []


async def test_a_stale_approval_card_never_answers_a_newer_request(
    browser: Browser, host: str
) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        await chat.say("approve echo harmless")
        await chat.sees(".approval", "echo harmless")
        await chat.say("/stop")
        await chat.sees(".msg.command", "Stopped the running turn")
        await chat.say("approve rm -rf /home")
        await chat.sees(".approval", "rm -rf /home")
        new = page.locator(".approval", has_text="rm -rf /home")
        old = page.locator(".approval", has_text="echo harmless")
        old_approve = old.get_by_role("button", name="Approve", exact=True)
        await expect(old_approve).to_be_disabled()  # its turn was stopped: settled
        await expect(old).to_contain_text("No longer asked")
        # a card the page could not settle (its turn's outcome never reached this tab)
        await old_approve.evaluate("button => { button.disabled = false; }")
        await old_approve.click(timeout=UI_WAIT)
        await chat.sees(".msg.command", "That approval is no longer pending")
        await expect(new.get_by_role("button", name="Approve", exact=True)).to_be_enabled()
        await shot(page, "web-approval-stale")
        await new.get_by_role("button", name="Deny", exact=True).click(timeout=UI_WAIT)
        await chat.sees(".msg.assistant", "denied: rm -rf /home")
        await expect(page.locator(".msg", has_text="Approved")).to_have_count(0)
        assert chat.errors == []


async def test_a_message_over_the_byte_limit_is_refused_and_kept(
    browser: Browser, host: str
) -> None:
    async with ChatPage.opened(browser, host) as chat:
        text = "漢" * 6000  # 6,000 characters, 18,000 bytes of UTF-8
        await chat.say(text)
        await chat.sees(".system.error", "Message too long (18000 bytes")
        box = chat.page.get_by_role("textbox", name="Message")
        await expect(box).to_have_value(text)
        await expect(chat.page.locator(".msg.user")).to_have_count(0)
        await shot(chat.page, "web-message-too-long")
        await chat.say("short")
        await chat.sees(".msg.assistant", "echo: short")


async def test_a_pasted_message_over_the_limit_is_refused_whole_not_cut(
    browser: Browser, host: str
) -> None:
    """A paste of more characters than the limit's bytes: the box keeps all of it (no
    ``maxlength`` cuts it short without a word), and the page refuses to send it."""
    async with ChatPage.opened(browser, host) as chat:
        text = "".join(f"line {n:05} of a long paste\n" for n in range(700))  # 18,900 bytes
        box = chat.page.get_by_role("textbox", name="Message")
        await box.focus()
        await chat.page.keyboard.insert_text(text)
        await expect(box).to_have_value(text)
        await box.press("Enter")
        await chat.sees(".system.error", f"Message too long ({len(text)} bytes; at most 16384)")
        await expect(box).to_have_value(text)
        await expect(chat.page.locator(".msg.user")).to_have_count(0)
        assert chat.errors == []


async def test_sign_in_with_the_access_token(browser: Browser, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("open sesame")
    config = Config(server=ServerConfig(token=Secret(file=str(token_file))))
    async with web_server(config) as host:
        context = await browser.new_context(viewport={"width": 1100, "height": 720})
        try:
            page = await context.new_page()
            requests: list[str] = []
            page.on("request", lambda request: requests.append(request.url))
            response = await page.goto(f"http://{host}/")
            assert response is not None
            assert response.status == 401
            await page.get_by_label("Access token").fill("not it")
            await page.get_by_role("button", name="Sign in").click()
            await expect(page.get_by_role("alert")).to_contain_text("not right")
            await shot(page, "web-sign-in")
            await page.get_by_label("Access token").fill("open sesame")
            await page.get_by_role("button", name="Sign in").click()
            chat = ChatPage(context, page)
            await chat.connected()
            assert page.url == f"http://{host}/"
            await chat.say("signed in")
            await chat.sees(".msg.assistant", "echo: signed in")
            assert chat.errors == []
            assert not [url for url in requests if "sesame" in url or "token=" in url]
            (session,) = [c for c in await context.cookies() if c["name"] == AUTH_COOKIE]
            assert "sesame" not in session["value"]
            assert session["expires"] > 0  # a session with an expiry, not a browser-long one
            assert session["httpOnly"]
            assert session["value"] != await signed_in_elsewhere(browser, host)
        finally:
            await context.close()


async def signed_in_elsewhere(browser: Browser, host: str) -> str:
    """Sign in from another browser profile; its sign-in cookie."""
    context = await browser.new_context()
    try:
        page = await context.new_page()
        await page.goto(f"http://{host}/")
        await page.get_by_label("Access token").fill("open sesame")
        await page.get_by_role("button", name="Sign in").click()
        await ChatPage(context, page).connected()
        (session,) = [c for c in await context.cookies() if c["name"] == AUTH_COOKIE]
        return session["value"]
    finally:
        await context.close()


RECORD_WAITS = """
window.waits = [];
const wait = window.setTimeout.bind(window);
window.setTimeout = (callback, delay, ...rest) => {
  window.waits.push(delay || 0);
  return wait(callback, delay, ...rest);
};
"""
"""Records every delay the page asks ``setTimeout`` for, in ``window.waits``."""


async def test_a_blocked_address_is_told_so_and_waits_out_the_block(
    browser: Browser, tmp_path: Path
) -> None:
    """A page whose socket is closed with 4429 (its address is blocked for wrong tokens)
    says so, and does not try again before the block ends (a wait of the seconds the close
    names, beyond the ten seconds a lost connection waits at most), instead of
    'Disconnected — reconnecting…' and a try every few seconds."""
    token_file = tmp_path / "token"
    token_file.write_text("open sesame")
    config = Config(server=ServerConfig(token=Secret(file=str(token_file))))
    right = {"Authorization": "Bearer open sesame"}
    async with web_server(config) as host:
        async with httpx.AsyncClient(base_url=f"http://{host}") as client:
            for guess in range(GUESSES):
                wrong = {"Authorization": f"Bearer guess {guess}", "X-Forwarded-For": GUESSER}
                assert (await client.get("/", headers=wrong)).status_code == 401
        # the socket comes from the blocked address, the page's files from another one
        context = await browser.new_context(
            extra_http_headers={**right, "X-Forwarded-For": GUESSER}
        )
        try:
            page = await context.new_page()
            await page.add_init_script(RECORD_WAITS)

            async def elsewhere(route: Route) -> None:
                headers = {**await route.request.all_headers(), "x-forwarded-for": NEIGHBOUR}
                await route.continue_(headers=headers)

            await page.route("**/*", elsewhere)
            await page.goto(f"http://{host}/")
            await expect(page.locator("#status")).to_have_text(
                "Too many wrong tokens from this address; try again in a minute", timeout=UI_WAIT
            )
            await shot(page, "web-too-many-wrong-tokens")
            waits: list[int] = await page.evaluate("window.waits")
            assert max(waits) > 10_000
        finally:
            await context.close()
