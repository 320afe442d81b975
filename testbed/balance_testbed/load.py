"""Concurrent requests through the ``openai`` client, with a stall watchdog.

Every request streams, so the client sees each token arrive: a server that stops producing
tokens while requests are outstanding is a ``Stall`` after ``stall_s`` (lesson A hangs the real
server with ``/health`` still answering 200, so a health probe cannot see it). Streams ask for
usage, so the token count is the server's own.

Prompts alternate between the completions and chat endpoints and spread their output lengths,
so requests admitted together do not finish together and ranks drain at different times: the
load that makes a DP=2 server with ``--max-num-seqs 4`` hit the cap and freeze admission.

    python -m balance_testbed.load --port 8000      # from the checkout: docs/operations.md's load
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from dataclasses import dataclass

from balance_testbed.tiny_moe import CORPUS
from balance_testbed.waiting import wait_for

MODEL_NAME = "tiny-moe"  # --served-model-name in balance_testbed.server
KINDS = ("completion", "chat")


@dataclass(frozen=True)
class Prompt:
    key: str
    kind: str
    text: str
    max_tokens: int


@dataclass
class Outcome:
    prompt: Prompt
    text: str = ""
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    seconds: float = 0.0


class Stall(RuntimeError):
    """No token arrived for ``stall_s`` while requests were outstanding."""

    def __init__(self, silent_s: float, outstanding: list[str], finished: int) -> None:
        super().__init__(
            f"no token for {silent_s:.0f} s with {len(outstanding)} requests outstanding "
            f"({finished} finished): {', '.join(sorted(outstanding)[:8])}"
        )
        self.outstanding = outstanding
        self.finished = finished


def make_prompts(count: int, seed: int = 0, min_tokens: int = 8, max_tokens: int = 48):
    """``count`` deterministic prompts, alternating endpoints, output lengths spread."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        words = " ".join(rng.sample(" ".join(CORPUS).split(), rng.randint(4, 24)))
        prompts.append(
            Prompt(
                key=f"{KINDS[index % 2][:4]}-{index:03d}",
                kind=KINDS[index % 2],
                text=words,
                max_tokens=rng.randint(min_tokens, max_tokens),
            )
        )
    return prompts


class Progress:
    """Tokens seen, when the last one arrived, which requests are still open, when the last ended.

    Shared with the caller (``BackgroundLoad``), which may act on it while the load runs, e.g.
    kill an engine core once tokens flow.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.last_token = time.monotonic()
        self.outstanding: set[str] = set()
        self.finished = 0
        self.last_finished = 0.0

    def token(self) -> None:
        self.tokens += 1
        self.last_token = time.monotonic()


async def _one(client, prompt: Prompt, progress: Progress) -> Outcome:
    outcome = Outcome(prompt)
    began = time.monotonic()
    common = dict(
        model=MODEL_NAME,
        max_tokens=prompt.max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        # Exactly max_tokens tokens: a random model may sample EOS at any step.
        extra_body={"ignore_eos": True},
    )
    progress.outstanding.add(prompt.key)
    pieces = []
    try:
        if prompt.kind == "completion":
            stream = await client.completions.create(prompt=prompt.text, **common)
        else:
            messages = [{"role": "user", "content": prompt.text}]
            stream = await client.chat.completions.create(messages=messages, **common)
        async for chunk in stream:
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                progress.token()
                piece = choice.text if prompt.kind == "completion" else choice.delta.content
                pieces.append(piece or "")
                outcome.finish_reason = choice.finish_reason or outcome.finish_reason
    except Exception as exc:  # every client-side failure is data for the test
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        progress.outstanding.discard(prompt.key)
        progress.finished += 1
        progress.last_finished = time.monotonic()
        outcome.text = "".join(pieces)
        outcome.seconds = time.monotonic() - began
    return outcome


async def _run(base_url, prompts, stall_s: float, timeout_s: float, progress: Progress):
    from openai import AsyncOpenAI

    progress.last_token = time.monotonic()
    async with AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s
    ) as client:
        tasks = [asyncio.create_task(_one(client, p, progress)) for p in prompts]
        deadline = time.monotonic() + timeout_s
        try:
            while not all(task.done() for task in tasks):
                await asyncio.sleep(0.25)
                silent = time.monotonic() - progress.last_token
                if progress.outstanding and silent > stall_s:
                    raise Stall(silent, list(progress.outstanding), progress.finished)
                if time.monotonic() > deadline:
                    raise Stall(silent, list(progress.outstanding), progress.finished)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [task.result() for task in tasks]


def send_concurrently(
    base_url: str,
    prompts: list[Prompt],
    stall_s: float = 60.0,
    timeout_s: float = 600.0,
    progress: Progress | None = None,
) -> list[Outcome]:
    """Send every prompt at once; returns outcomes in prompt order, or raises ``Stall``."""
    return asyncio.run(_run(base_url, prompts, stall_s, timeout_s, progress or Progress()))


class BackgroundLoad(threading.Thread):
    """``send_concurrently`` in a thread; the caller watches ``progress`` meanwhile."""

    def __init__(self, base_url: str, prompts: list[Prompt], **options) -> None:
        super().__init__(daemon=True)
        self.base_url, self.prompts, self.options = base_url, prompts, options
        self.progress = Progress()
        self.outcomes: list[Outcome] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.outcomes = send_concurrently(
                self.base_url, self.prompts, progress=self.progress, **self.options
            )
        except BaseException as exc:  # handed to the caller through ``error``
            self.error = exc

    def wait_for_tokens(self, count: int, timeout_s: float) -> bool:
        """Whether ``count`` tokens arrived within ``timeout_s`` (False at once if the load ended
        short of them)."""
        wait_for(lambda: self.progress.tokens >= count or not self.is_alive(), timeout_s, 0.1)
        return self.progress.tokens >= count


# ------------------------------------------------------------------------ the command
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m balance_testbed.load",
        description="Send concurrent streamed requests (completions and chat, greedy, output "
        f"lengths spread) to a server serving {MODEL_NAME!r}, as the e2e tests do, and report "
        "how many came back with their requested token count. Exit status 0 when all did.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="server address (%(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="server port (%(default)s)")
    parser.add_argument(
        "--requests", type=int, default=48, help="requests, all sent at once (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (%(default)s)")
    parser.add_argument(
        "--stall-s",
        type=float,
        default=60.0,
        help="give up when no token arrived for this long (%(default)s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base_url = f"http://{args.host}:{args.port}"
    prompts = make_prompts(args.requests, args.seed)
    began = time.monotonic()
    try:
        outcomes = send_concurrently(base_url, prompts, stall_s=args.stall_s)
    except Stall as stall:
        print(f"load: {stall}", file=sys.stderr)
        return 1
    wrong = [o for o in outcomes if o.error or o.completion_tokens != o.prompt.max_tokens]
    kinds = ", ".join(f"{sum(p.kind == kind for p in prompts)} {kind}" for kind in KINDS)
    print(
        f"{len(outcomes) - len(wrong)} of {len(outcomes)} requests ({kinds}) to {base_url} "
        f"returned their requested token count in {time.monotonic() - began:.1f} s"
    )
    for outcome in wrong:
        got = outcome.error or f"{outcome.completion_tokens} of {outcome.prompt.max_tokens} tokens"
        print(f"  {outcome.prompt.key}: {got}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
