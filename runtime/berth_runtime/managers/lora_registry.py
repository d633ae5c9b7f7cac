"""LoraRegistry (API process): the adapter names requests may ask for, how a request's `model`
names one, and loading and unloading them through the scheduler."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from http import HTTPStatus

from berth_common.errors import RequestError
from berth_runtime.io_struct import (
    LoadLoraAdapterReq,
    LoraAdapterOut,
    ToScheduler,
    UnloadLoraAdapterReq,
)


class LoraRegistry:
    """Adapter name -> the path it was loaded from. An adapter is listed once the scheduler has
    loaded it, and unlisted as soon as its unload starts (new requests for it get 404 while the
    running ones finish)."""

    def __init__(
        self, base_name: str, enabled: bool, adapters: dict[str, str], send: Callable
    ) -> None:
        self.base_name = base_name
        self.enabled = enabled
        self.adapters = dict(adapters)
        self._send: Callable[[ToScheduler], None] = send
        self._waiters: dict[str, asyncio.Future[LoraAdapterOut]] = {}

    def resolve(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (NAME or BASE:NAME), None for the base model;
        RequestError 404 for anything else."""
        if model is None or model == self.base_name:
            return None
        name = model.removeprefix(f"{self.base_name}:")
        if name in self.adapters:
            return name
        served = f"`{self.base_name}`"
        if self.adapters:
            served += " and the LoRA adapters " + ", ".join(f"`{a}`" for a in self.adapters)
        what = f"LoRA adapter `{name}`" if name != model else f"model `{model}`"
        raise RequestError(
            f"The {what} does not exist; this server serves {served}.",
            HTTPStatus.NOT_FOUND,
            err_type="NotFoundError",
            param="model",
            code="model_not_found",
        )

    def check_name(self, name: str | None, param: str) -> None:
        """A /generate `lora_path` must name a loaded adapter."""
        if name is not None and name not in self.adapters:
            if not self.enabled:
                raise RequestError(
                    "LoRA adapters are off on this server (start it with --enable-lora)",
                    param=param,
                )
            raise RequestError(
                f"no LoRA adapter named {name!r} is loaded", HTTPStatus.NOT_FOUND, param=param
            )

    async def load(self, name: str, path: str) -> LoraAdapterOut:
        self._check_enabled()
        if name in self.adapters:
            raise RequestError(
                f"an adapter named {name!r} is loaded already; unload it first",
                HTTPStatus.CONFLICT,
                param="lora_name",
            )
        out = await self._ask(lambda req_id: LoadLoraAdapterReq(req_id, name, path))
        if out.success:
            self.adapters[name] = path
        return out

    async def unload(self, name: str) -> LoraAdapterOut:
        """Returns once the adapter's running and queued requests are done and it is gone."""
        self._check_enabled()
        if name not in self.adapters:
            raise RequestError(
                f"no LoRA adapter named {name!r} is loaded",
                HTTPStatus.NOT_FOUND,
                param="lora_name",
            )
        path = self.adapters.pop(name)
        out = await self._ask(lambda req_id: UnloadLoraAdapterReq(req_id, name))
        if not out.success and out.status_code != HTTPStatus.NOT_FOUND:
            self.adapters[name] = path
        return out

    def answer(self, out: LoraAdapterOut) -> None:
        waiter = self._waiters.pop(out.req_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(out)

    def fail_all(self, reason: str) -> None:
        """The engine died: every load or unload in flight fails."""
        for req_id in list(self._waiters):
            self.answer(LoraAdapterOut(req_id, success=False, message=reason, status_code=500))

    async def _ask(self, make: Callable[[str], ToScheduler]) -> LoraAdapterOut:
        req_id = uuid.uuid4().hex
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[req_id] = waiter
        try:
            self._send(make(req_id))
            return await waiter
        finally:
            self._waiters.pop(req_id, None)

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise RequestError("LoRA adapters are off on this server (start it with --enable-lora)")
