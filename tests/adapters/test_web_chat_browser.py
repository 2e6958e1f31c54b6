"""What the web chat shows, in a real browser: Markdown, the running turn, phones, access.

Each test drives a real gateway over a real WebSocket with Debian's chromium
and saves a screenshot of every state it reaches (see ``test_web_browser``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest
from playwright.async_api import Browser, Page, expect

from chatlane.config import Config
from chatlane.runtime.busy import BusyPolicy, BusySettings
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.turn import Turn
from tests.adapters.test_web import web_server
from tests.adapters.test_web_browser import (
    CHROMIUM,
    UI_WAIT,
    ChatPage,
    browser,
    host,
    shot,
)

__all__ = ["browser", "host"]  # the fixtures, shared with test_web_browser

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"
)

XSS = "\n\n".join(
    [
        "Look:",
        "<script>window.pwned = 'script'</script>",
        '<img src="nowhere.png" onerror="window.pwned = \'img\'">',
        "[a link](javascript:window.pwned='link') and [a good one](https://example.org/x)",
        "<a href=\"javascript:window.pwned='anchor'\">raw anchor</a>",
        "![a picture](nowhere.png\" onerror=\"window.pwned='image')",
        '<svg onload="window.pwned=\'svg\'"></svg><iframe src="javascript:1"></iframe>',
        "| language | year |\n|:--|--:|\n| Python | 1991 |\n| Lua | 1993 |",
        "- one\n- **two**\n\n1. first\n2. second",
        "```python\ndef greet(name):\n    return f'hello {name}'  # a comment\n```",
    ]
)


def state_of(page: Page, text: str) -> Any:
    """The state line of the user's message saying ``text``."""
    return page.locator(".msg.user", has_text=text).locator(".msg-state")


async def test_markdown_is_rendered_and_nothing_in_it_runs(browser: Browser, host: str) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        dialogs: list[str] = []
        page.on("dialog", lambda dialog: dialogs.append(dialog.message))
        await chat.context.grant_permissions(["clipboard-read", "clipboard-write"])
        await chat.say(XSS)
        reply = page.locator(".msg.assistant").last
        await expect(reply.locator(".code-block")).to_have_count(1, timeout=UI_WAIT)
        await expect(reply).not_to_have_class(re.compile("streaming"))

        await expect(reply.locator("table th")).to_have_text(["language", "year"])
        await expect(reply.locator("table td[align=right]")).to_have_text(["1991", "1993"])
        await expect(reply.locator("ul > li")).to_have_text(["one", "two"])
        await expect(reply.locator("ol > li")).to_have_text(["first", "second"])
        await expect(reply.locator("strong")).to_have_text("two")

        good = reply.get_by_role("link", name="a good one")
        await expect(good).to_have_attribute("href", "https://example.org/x")
        await expect(good).to_have_attribute("target", "_blank")
        await expect(good).to_have_attribute("rel", "noopener noreferrer")
        await expect(reply.locator("a[href^=javascript i]")).to_have_count(0)
        await expect(page.locator(".log img, .log svg, .log iframe, .log script")).to_have_count(0)
        for shown in ("<script>", "<img", "onerror", "raw anchor", "<svg"):
            await expect(reply).to_contain_text(shown)  # raw HTML is text
        user = page.locator(".msg.user").last
        await expect(user.locator(".text")).to_have_text(XSS)  # the user's own text, verbatim

        code = reply.locator(".code-block code")
        await expect(code.locator(".hljs-keyword").first).to_have_text("def")
        await expect(code.locator(".hljs-comment")).to_have_text("# a comment")
        await expect(reply.locator(".code-language")).to_have_text("python")
        font = await code.evaluate("node => getComputedStyle(node).fontFamily")
        assert "mono" in font.lower()
        await reply.get_by_role("button", name="Copy code").click()
        await expect(reply.get_by_role("button", name="Copy code")).to_have_text("Copied")
        copied = await page.evaluate("navigator.clipboard.readText()")
        assert copied == "def greet(name):\n    return f'hello {name}'  # a comment\n"
        await shot(page, "web-markdown")

        await reply.locator("a", has_text="a link").click()  # no href: nothing happens
        assert await page.evaluate("window.pwned") is None
        assert dialogs == []
        assert chat.errors == []


IN_HTML = '<script>window.__xss = 1</script>\n<img src=x onerror="window.__xss = 1">\n'
IN_JAVASCRIPT = "el.innerHTML = '<img src=x onerror=\"window.__xss = 1\">';\n"
IN_UNKNOWN = '<svg onload="window.__xss = 1"></svg>\n'
IN_HTML_LANGUAGE = '</code></pre><img src=x onerror="window.__xss = 1">\n'
INLINE = ['<img src=x onerror="window.__xss = 1">', "</code><script>window.__xss = 1</script>"]
CODE_XSS = "".join(
    [
        "Code:\n\n",
        f"```html\n{IN_HTML}```\n\n",
        f"```javascript\n{IN_JAVASCRIPT}```\n\n",
        f"```nosuchlanguage\n{IN_UNKNOWN}```\n\n",
        # a language named with HTML, and code that tries to close its block
        f'```"><img src=x onerror="window.__xss = 1">\n{IN_HTML_LANGUAGE}```\n\n',
        f"Inline: `{INLINE[0]}` and `{INLINE[1]}`",
    ]
)
RUNS = """
() => [...document.querySelectorAll(".log *")]
  .filter((node) => [...node.attributes].some((a) => a.name.toLowerCase().startsWith("on")))
  .map((node) => node.outerHTML.slice(0, 80))
"""


async def test_html_in_code_is_shown_highlighted_as_text_and_copied_verbatim(
    browser: Browser, host: str
) -> None:
    """Code blocks, of a known, an unknown or an HTML-made language, and inline code
    show HTML as text: no element of it is made, nothing of it runs, Copy gives it back."""
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        dialogs: list[str] = []
        page.on("dialog", lambda dialog: dialogs.append(dialog.message))
        await chat.context.grant_permissions(["clipboard-read", "clipboard-write"])
        await chat.say(CODE_XSS)
        reply = page.locator(".msg.assistant").last
        await expect(reply.locator(".code-block")).to_have_count(4, timeout=UI_WAIT)
        await expect(reply).not_to_have_class(re.compile("streaming"))

        payload = page.locator(".log script, .log img, .log svg, .log iframe")
        await expect(payload).to_have_count(0)
        assert await page.evaluate(RUNS) == []
        assert await page.evaluate("typeof window.__xss") == "undefined"

        labels = reply.locator(".code-language")
        await expect(labels).to_have_text(["html", "javascript", "nosuchlanguage", "code"])
        code = reply.locator(".code-block pre > code")
        shown = await code.evaluate_all("nodes => nodes.map((node) => node.textContent)")
        assert shown == [IN_HTML, IN_JAVASCRIPT, IN_UNKNOWN, IN_HTML_LANGUAGE]
        html = code.first
        await expect(html).to_have_class(re.compile(r"\bhljs\b"))
        await expect(html.locator(".hljs-tag .hljs-name")).to_have_text(["script", "script", "img"])
        await expect(code.nth(1).locator(".hljs-string")).to_contain_text("<img src=x")
        await expect(reply.locator("p > code")).to_have_text(INLINE)

        await reply.get_by_role("button", name="Copy code").first.click()
        await expect(reply.get_by_role("button", name="Copy code").first).to_have_text("Copied")
        assert await page.evaluate("navigator.clipboard.readText()") == IN_HTML
        await shot(page, "web-code-xss")
        assert await page.evaluate("typeof window.__xss") == "undefined"
        assert dialogs == []
        assert chat.errors == []


class Paced:
    """An agent streaming its reply in stages: the first at once, each next one only
    once the test lets it out with :meth:`next`; the turn ends with the last."""

    def __init__(self, *stages: list[str]) -> None:
        self.stages = stages
        self.gates = [asyncio.Event() for _ in stages[1:]]

    def next(self) -> None:
        """Let the next stage's chunks out."""
        next(gate for gate in self.gates if not gate.is_set()).set()

    async def __call__(self, turn: Turn) -> AsyncIterator[str]:
        for number, stage in enumerate(self.stages):
            if number:
                await self.gates[number - 1].wait()
            for chunk in stage:
                yield chunk


STEPS = "".join(f"{n}. step {n}\n" for n in range(1, 31))  # taller than the log


async def test_a_reply_is_rendered_safely_as_it_streams(browser: Browser) -> None:
    """Each chunk shows the reply so far as Markdown, raw HTML as text even in a code
    block not closed yet; the finished reply is rendered whole and kept in view."""
    agent = Paced(
        ["# Title\n\n", "- one\n", "- **tw", "o**"],
        ['\n\n<img src=x onerror="window.__xss = 1">\n\n', "```html\n<script>window.__xss"],
        [" = 1</script>\n```\n\n", STEPS, "\nThe **end**."],
    )
    async with web_server(agent=agent) as address, ChatPage.opened(browser, address) as chat:
        page = chat.page
        await chat.say("tell me")
        reply = page.locator(".msg.assistant").last
        await expect(reply.locator("li")).to_have_text(["one", "two"], timeout=UI_WAIT)
        await expect(reply).to_have_class(re.compile(r"\bstreaming\b"))
        await expect(reply).to_have_attribute("aria-busy", "true")
        await expect(reply.locator("h1")).to_have_text("Title")
        await expect(reply.locator("li strong")).to_have_text("two")
        await expect(reply.locator(".text")).to_have_text(re.compile(r"^[^#*]+$"))
        await shot(page, "web-reply-streaming")

        agent.next()  # raw HTML, then a code block still open
        code = reply.locator(".code-block code")
        await expect(code).to_have_text("<script>window.__xss", timeout=UI_WAIT)
        await expect(reply).to_contain_text('<img src=x onerror="window.__xss = 1">')
        await expect(reply).to_have_class(re.compile(r"\bstreaming\b"))
        await expect(page.locator(".log script, .log img")).to_have_count(0)

        agent.next()  # the rest, and the turn ends
        await expect(reply).not_to_have_class(re.compile(r"\bstreaming\b"), timeout=UI_WAIT)
        await expect(reply).not_to_have_attribute("aria-busy", "true")
        await expect(code).to_have_text("<script>window.__xss = 1</script>")
        await expect(reply.locator(".code-language")).to_have_text("html")
        await expect(reply.locator("ol > li")).to_have_count(30)
        end = reply.locator("p", has_text="The end")
        await expect(end.locator("strong")).to_have_text("end")
        await expect(end).to_be_in_viewport()
        await expect(page.locator(".msg.assistant")).to_have_count(1)
        await expect(page.locator(".log script, .log img")).to_have_count(0)
        assert await page.evaluate("typeof window.__xss") == "undefined"
        await shot(page, "web-reply-streamed")
        assert chat.errors == []


async def test_the_running_turn_its_queue_and_stop(browser: Browser, host: str) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        activity = page.locator("#activity")
        await expect(activity).to_be_hidden()
        await chat.say("approve rm -rf build")
        await chat.sees(".approval", "rm -rf build")
        await expect(activity).to_be_visible()
        await expect(page.locator("#activity-label")).to_have_text("Working")
        await expect(page.locator("#activity-elapsed")).to_have_text(re.compile(r"^[1-9]\d* s$"))
        await expect(state_of(page, "approve rm -rf build")).to_have_text("Running")

        await chat.say("first in line")
        await chat.say("second in line")
        await expect(state_of(page, "first in line")).to_contain_text(re.compile(r"Queued · #\d+"))
        await expect(state_of(page, "second in line")).to_contain_text("Queued")
        await expect(page.locator("#activity-waiting")).to_have_text("2 waiting")
        await shot(page, "web-turn-queued")

        first = state_of(page, "first in line")
        await first.get_by_role("button", name=re.compile("Cancel queued message")).click()
        await expect(first).to_have_text("Cancelled")
        await chat.say("/status")
        answer = page.locator(".msg.command", has_text="Status: running")
        await expect(answer).to_be_visible(timeout=UI_WAIT)
        await expect(answer).to_contain_text("second in line")
        await expect(answer).not_to_contain_text("first in line")
        await expect(page.locator(".msg.assistant", has_text="Status:")).to_have_count(0)
        await shot(page, "web-turn-cancelled")

        await page.get_by_role("button", name="Stop", exact=True).click()
        await chat.sees(".msg.command", "Stopped the running turn")
        await expect(state_of(page, "approve rm -rf build")).to_have_text("Stopped")
        await expect(state_of(page, "second in line")).to_have_text("Dropped — not run")
        await expect(activity).to_be_hidden()
        await shot(page, "web-turn-stopped")

        await chat.say("hello again")
        await chat.sees(".msg.assistant", "echo: hello again")
        await expect(state_of(page, "hello again")).to_have_count(0)  # answered: no state line
        assert chat.errors == []


async def test_a_steer_its_agent_has_not_taken_can_be_cancelled(
    browser: Browser, host: str
) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        await chat.say("approve deploy")
        await chat.sees(".approval", "deploy")
        await chat.say("/steer look at the logs")
        steered = state_of(page, "/steer look at the logs")
        await expect(steered).to_contain_text(re.compile(r"Steered into the running turn · #\d+"))
        await steered.get_by_role("button", name=re.compile("Cancel queued message")).click()
        await expect(steered).to_have_text("Cancelled")
        await chat.sees(".msg.command", "back from the running turn")
        assert chat.errors == []


async def test_merged_steered_interrupted_and_refused_messages(browser: Browser) -> None:
    config = Config(runtime=RuntimeSettings(busy=BusySettings(BusyPolicy.COLLECT)))
    async with web_server(config) as address, ChatPage.opened(browser, address) as chat:
        page = chat.page
        await chat.say("approve deploy")
        await chat.sees(".approval", "deploy")
        await chat.say("/steer look at the logs")  # steered only while nothing waits
        await expect(state_of(page, "/steer look at the logs")).to_contain_text("Steered")
        await shot(page, "web-turn-steered")
        await chat.say("one more thing")
        await chat.say("and another")
        await expect(state_of(page, "and another")).to_contain_text("Merged into the next turn")
        await shot(page, "web-turn-merged")
        await chat.say("/now forget it")
        await expect(state_of(page, "/now forget it")).to_contain_text(
            re.compile("Interrupting|Running")
        )
        await expect(state_of(page, "approve deploy")).to_have_text("Interrupted")
        card = page.locator(".approval", has_text="deploy")
        await expect(card.get_by_role("button", name="Approve")).to_be_disabled()
        await expect(card).to_contain_text("No longer asked")
        await chat.sees(".msg.assistant", "echo: forget it")
        await shot(page, "web-turn-interrupted")

        await chat.say("/busy reject")
        await chat.sees(".msg.command", "Busy policy for this session: reject")
        await chat.say("approve publish")
        await chat.sees(".approval", "publish")
        await chat.say("too soon")
        await expect(state_of(page, "too soon")).to_have_text("Refused — not run")
        await shot(page, "web-turn-refused")
        assert chat.errors == []


async def test_conversations_are_listed_by_their_titles(browser: Browser, host: str) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        current = page.locator("#conversations button[aria-current=true]")
        await chat.say("#  Plan the   trip\nto Lisbon, with every detail we talked about")
        await chat.sees(".msg.assistant", "echo: #  Plan the")
        await expect(current).to_have_attribute("data-titled", "yes", timeout=UI_WAIT)
        await expect(current.locator(".conversation-title")).to_have_text("Plan the trip")
        await expect(page.locator("#chat-heading")).to_have_text("Plan the trip")

        await page.get_by_role("button", name="New conversation").click()
        await chat.sees(".msg.command", "Started a new conversation")
        await chat.say("Second one")
        await chat.sees(".msg.assistant", "echo: Second one")
        await page.reload()
        await chat.connected()
        titles = page.locator("#conversations .conversation-title")
        await expect(titles).to_have_text(["Second one", "Plan the trip"], timeout=UI_WAIT)
        await shot(page, "web-titles")

        await chat.say("/resume")
        listing = page.locator(".msg.command", has_text="Recent conversations").last
        await expect(listing).to_contain_text("1. Second one", timeout=UI_WAIT)
        await expect(listing).to_contain_text("2. Plan the trip")
        await expect(listing).not_to_contain_text("c_")
        await page.locator("#conversations button", has_text="Plan the trip").click()
        await expect(current).to_contain_text("Plan the trip", timeout=UI_WAIT)
        await expect(page.locator("#chat-heading")).to_have_text("Plan the trip")
        assert chat.errors == []


async def test_resume_with_title_words_shows_that_conversation(browser: Browser, host: str) -> None:
    """``/resume`` with words of a title, typed in any case and order, switches to the
    conversation so titled and the page shows it, then and after a reload; no
    conversation's id is ever shown."""
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        current = page.locator("#conversations button[aria-current=true]")
        await chat.say("Plan the trip to Lisbon")
        await chat.sees(".msg.assistant", "echo: Plan the trip to Lisbon")
        await expect(current).to_have_attribute("data-titled", "yes", timeout=UI_WAIT)
        await page.get_by_role("button", name="New conversation").click()
        await chat.sees(".msg.command", "Started a new conversation")
        await chat.say("Budget for the year")
        await chat.sees(".msg.assistant", "echo: Budget for the year")
        await expect(current).to_have_attribute("data-titled", "yes", timeout=UI_WAIT)

        await chat.say("/resume lisbon TRIP")
        answer = page.locator(".msg.command", has_text="Resumed")
        await expect(answer).to_contain_text("“Plan the trip to Lisbon”", timeout=UI_WAIT)
        await expect(page.locator("#chat-heading")).to_have_text("Plan the trip to Lisbon")
        await expect(current.locator(".conversation-title")).to_have_text("Plan the trip to Lisbon")
        log = page.get_by_role("log", name="Messages")
        await expect(log.locator(".msg.user .text")).to_have_text(["Plan the trip to Lisbon"])
        await expect(log.locator(".msg.assistant .text")).to_have_text(
            ["echo: Plan the trip to Lisbon"]
        )
        await expect(log).not_to_contain_text("Budget")
        await shot(page, "web-resumed-by-title")
        await no_conversation_id_is_shown(page)

        await page.reload()
        await chat.connected()
        await expect(page.locator("#chat-heading")).to_have_text("Plan the trip to Lisbon")
        await expect(log.locator(".msg.user .text")).to_have_text(["Plan the trip to Lisbon"])
        await no_conversation_id_is_shown(page)
        assert chat.errors == []


async def no_conversation_id_is_shown(page: Page) -> None:
    """Neither id the conversation list holds, nor anything shaped like one, is visible."""
    items = page.locator("#conversations button")
    await expect(items).to_have_count(2)
    ids = [await item.get_attribute("data-conversation") for item in await items.all()]
    assert all(conversation and conversation.startswith("c_") for conversation in ids)
    shown = await page.locator("body").inner_text()
    assert not re.search(r"\bc_\w", shown)
    assert not [conversation for conversation in ids if conversation and conversation in shown]


async def test_a_narrow_screen_keeps_the_conversations_in_a_drawer(
    browser: Browser, host: str
) -> None:
    context = await browser.new_context(viewport={"width": 390, "height": 800})
    page = await context.new_page()
    chat = ChatPage(context, page)
    try:
        await page.goto(f"http://{host}/")
        await chat.connected()
        await chat.say("a" * 3000)  # one word, far wider than the screen
        await chat.sees(".msg.assistant", "echo: aaa")
        overflow = await page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0
        sidebar = page.locator("#sidebar")
        menu = page.get_by_role("button", name="Conversations")
        await expect(sidebar).to_be_hidden()
        await expect(menu).to_have_attribute("aria-expanded", "false")
        await shot(page, "web-mobile")

        await menu.click()
        await expect(sidebar).to_be_visible()
        await expect(menu).to_have_attribute("aria-expanded", "true")
        await expect(page.get_by_role("button", name="New conversation")).to_be_focused()
        await shot(page, "web-mobile-drawer")
        await page.keyboard.press("Escape")
        await expect(sidebar).to_be_hidden()
        await expect(menu).to_be_focused()

        await menu.click()
        await page.get_by_role("button", name="New conversation").click()
        await expect(sidebar).to_be_hidden()
        await chat.sees(".msg.command", "Started a new conversation")
        assert chat.errors == []
    finally:
        await context.close()


CONTRASTED = [
    ".msg.user .text",
    ".msg-state-text",
    ".msg-state .cancel",
    ".msg.assistant .text p",
    ".hljs-keyword",
    ".hljs-string",
    ".hljs-comment",
    ".code-language",
    ".code-bar .copy",
    ".msg.command .text",
    ".system.ack",
    ".system.notice",
    ".system.error",
    "#activity-label",
    ".activity-elapsed",
    ".activity .stop",
    ".approval-text",
    ".approval .approve",
    ".approval .deny",
    ".conversation-title",
    ".conversation-meta",
    ".sidebar-heading",
    "#status",
    "#send",
]

CONTRAST = """
(selectors) => {
  const rgb = (css) => {
    const parts = css.match(/[\\d.]+/g).map(Number);
    return { r: parts[0], g: parts[1], b: parts[2], a: parts.length > 3 ? parts[3] : 1 };
  };
  const channel = (v) => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
  const luminance = (c) => 0.2126 * channel(c.r) + 0.7152 * channel(c.g) + 0.0722 * channel(c.b);
  const behind = (node) => {
    for (let n = node; n; n = n.parentElement) {
      const color = rgb(getComputedStyle(n).backgroundColor);
      if (color.a > 0.5) return color;
    }
    return rgb(getComputedStyle(document.documentElement).backgroundColor);
  };
  const found = [];
  for (const selector of selectors) {
    const node = document.querySelector(selector);
    if (!node) { found.push([selector, 0]); continue; }
    const [a, b] = [luminance(rgb(getComputedStyle(node).color)), luminance(behind(node))];
    found.push([selector, (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)]);
  }
  return found;
}
"""

NAMELESS = """
() => [...document.querySelectorAll("button, textarea, input, [role=option]")]
  .filter((node) => {
    const label = node.labels && [...node.labels].map((l) => l.textContent).join("");
    const by = node.getAttribute("aria-labelledby");
    const named = node.getAttribute("aria-label") || label || node.textContent
      || (by && document.getElementById(by)?.textContent);
    return !(named || "").trim();
  })
  .map((node) => node.outerHTML.slice(0, 80))
"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
async def test_every_control_is_named_focusable_and_readable(
    browser: Browser, host: str, scheme: Literal["light", "dark"]
) -> None:
    context = await browser.new_context(
        viewport={"width": 1100, "height": 900}, color_scheme=scheme
    )
    page = await context.new_page()
    chat = ChatPage(context, page)
    try:
        await page.goto(f"http://{host}/")
        await chat.connected()
        await chat.say("Some *Markdown*:\n\n```python\nif x:\n    print('hi')  # greet\n```")
        await chat.sees(".msg.assistant .code-block", "print")
        await chat.say("approve rm -rf build")
        await chat.sees(".approval", "rm -rf build")
        await chat.say("waits its turn")
        await chat.say("also waits")
        await chat.sees(".system.ack", "Queued")
        also = state_of(page, "also waits")
        await also.get_by_role("button", name=re.compile("Cancel queued message")).click()
        await chat.sees(".system.notice", "Taken out of the queue")
        await chat.say("/status")
        await chat.sees(".msg.command", "Status:")
        await chat.say("漢" * 6000)
        await chat.sees(".system.error", "Message too long")
        await expect(state_of(page, "waits its turn")).to_contain_text("Queued")
        await shot(page, f"web-{scheme}")

        ratios = dict(await page.evaluate(CONTRAST, CONTRASTED))
        assert {s: r for s, r in ratios.items() if r < 4.5} == {}
        assert await page.evaluate(NAMELESS) == []
        log = page.get_by_role("log", name="Messages")
        await expect(log).to_have_attribute("aria-live", "polite")

        await page.get_by_role("textbox", name="Message").focus()
        await page.keyboard.press("Shift+Tab")  # back from the message box: the Stop button
        stop = page.get_by_role("button", name="Stop", exact=True)
        await expect(stop).to_be_focused()
        outline = await stop.evaluate(
            "n => [getComputedStyle(n).outlineStyle, parseFloat(getComputedStyle(n).outlineWidth)]"
        )
        assert outline[0] != "none"
        assert outline[1] >= 2
        assert chat.errors == []
    finally:
        await context.close()


ODD = [
    "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇ text",
    "\u202eright-to-left override\u202c and \u200d\U0001f9d1\u200d\U0001f4bb and \x00 NUL",
    "</div></main><b>not bold</b><style>body{display:none}</style>",
    "&lt;escaped&gt; &amp; `<code>` \\*not italic\\*",
]


async def test_odd_long_and_html_looking_messages_never_break_the_page(
    browser: Browser, host: str
) -> None:
    async with ChatPage.opened(browser, host) as chat:
        page = chat.page
        for text in ODD:
            await chat.say(text)
            await expect(page.locator(".msg.user .text").last).to_have_text(text)
            await chat.sees(".msg.assistant", "echo:")
            await expect(page.locator(".msg.assistant")).to_have_count(ODD.index(text) + 1)
        long = ("word " * 3000).strip()  # 14,999 bytes
        await chat.say(long)
        await expect(page.locator(".msg.assistant")).to_have_count(len(ODD) + 1, timeout=UI_WAIT)
        await expect(page.locator(".log b, .log style")).to_have_count(0)
        await expect(page.locator("body")).to_be_visible()
        width = await page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert width <= 0
        await shot(page, "web-odd-input")
        assert chat.errors == []
