"""README.md's Python snippets, run exactly as printed, each as its own process, against the
shipped pair served as `make run` serves it (draft, target with its HTTP door, controller; an
ops token and an API key set), found through the environment variables the snippets read."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import pytest_asyncio

from controller.service.server import start as start_controller
from specpair.config import MODELS_DIR, ControllerConfig, ServerConfig
from tests.service.conftest import Stack, draft_config, eventually, target_config

pytestmark = pytest.mark.asyncio(loop_scope="module")
ROOT = MODELS_DIR.parent
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
TOKEN, KEY = "ops-token", "sk-readme"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def environment() -> AsyncIterator[dict[str, str]]:
    def with_token(config):  # type: ignore[no-untyped-def]
        return replace(config, server=replace(config.server, ops_token=TOKEN))

    stack = await Stack(
        with_token(draft_config(MODELS_DIR / "draft")),
        with_token(target_config(MODELS_DIR / "target", http_address="127.0.0.1:0", api_key=KEY)),
    ).start()
    target = f"127.0.0.1:{stack.target.port}"
    controller = await start_controller(
        ControllerConfig(ServerConfig("127.0.0.1:0", ops_token=TOKEN), targets=(target,))
    )
    await eventually(lambda: controller.controller.snapshot()[0].connected, timeout=15)
    env = {
        **os.environ,
        "SPECPAIR_TARGET_ADDRESS": target,
        "SPECPAIR_CONTROLLER_ADDRESS": f"127.0.0.1:{controller.port}",
        "SPECPAIR_HTTP_ADDRESS": f"127.0.0.1:{stack.target.http_port}",
        "SPECPAIR_OPS_TOKEN": TOKEN,
        "SPECPAIR_API_KEY": KEY,
    }
    yield env
    await controller.stop(grace=0.1)
    await stack.stop()


async def test_the_readme_has_its_four_snippets() -> None:
    assert len(SNIPPETS) == 4  # the SDK (blocking, asyncio), the controller, OpenAI's client


@pytest.mark.parametrize("index", range(4))
async def test_a_readme_snippet_runs_as_printed(environment: dict[str, str], index: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SNIPPETS[index],
        cwd=ROOT,
        env=environment,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.strip(), "the snippet printed nothing"
