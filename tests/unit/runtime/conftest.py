"""Fixtures of the serving tests (chat, completions): the scripted TokenizerManager and clients.

`tokenizer` is the embedded model's tokenizer (a test module may define its own); `tm` a fresh
`FakeTokenizerManager`; `http` an httpx client on the test app; `sdk` the OpenAI SDK over `http`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from openai import AsyncOpenAI
from transformers import PreTrainedTokenizerBase

from tests.unit.runtime.fakes import FakeTokenizerManager, build_app, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer()


@pytest.fixture
def tm(tokenizer: PreTrainedTokenizerBase) -> FakeTokenizerManager:
    return FakeTokenizerManager(tokenizer)


@pytest.fixture
async def http(tm: FakeTokenizerManager) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(tm))
    async with httpx.AsyncClient(transport=transport, base_url="http://berth") as client:
        yield client


@pytest.fixture
async def sdk(http: httpx.AsyncClient) -> AsyncOpenAI:
    return AsyncOpenAI(base_url="http://berth/v1", api_key="x", http_client=http, max_retries=0)
