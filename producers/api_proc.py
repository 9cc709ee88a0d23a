"""The sampler of ``busctl serve``: one vLLM engine (:func:`producers.engines.build_engine`) that answers the
``sample`` calls of the API process on the ``samplers`` topic, concurrently (vLLM batches them). Each call
names the weights it samples from: the base model, or a ``save_weights_for_sampler`` directory of merged
safetensors written by the trainer; the engine switches weights between calls (in-flight calls of the old
weights finish first), through the same reload path as the filesystem weight method (docs/ARCHITECTURE.md,
"Weights"), so one engine serves every tenant's sampler in turn.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from bus.api_link import ApiServer
from bus.component import Component, component_main
from bus.messages import new_id
from bus.messages_api import ApiCall, ApiReply
from configs.model_path import resolve_model_path
from producers.engines import build_engine

log = logging.getLogger(__name__)


class SamplerApiProc(Component):
    """A ``producer-I`` of a ``busctl serve`` run: vLLM engine + the ``samplers`` ROUTER."""

    def setup(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = build_engine(self.cfg, self.index, self.name)
        self.loop.run_until_complete(self.engine.start())
        self.server = ApiServer(self.ctx, self.endpoints.address("samplers"))
        self.weights = ""  # the weights directory the engine holds ("" = the base model as loaded)
        self.version = 0
        self.in_flight = 0
        self.idle = asyncio.Event()

    def run(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self.switch = asyncio.Lock()
        tasks: set[asyncio.Task] = set()
        while not self.stop.is_set():
            got = self.server.recv(timeout_s=0)
            if got is None:
                await asyncio.sleep(0.005)
                continue
            identity, call = got
            task = asyncio.create_task(self._answer(identity, call))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in tasks:
            task.cancel()

    async def _answer(self, identity: bytes, call: ApiCall) -> None:
        try:
            body = await self._sample(call)
            reply = ApiReply(id=new_id(), call_id=call.id, ok=True, error="", category="", body=body)
        except ValueError as err:
            reply = ApiReply(id=new_id(), call_id=call.id, ok=False, error=str(err), category="user", body={})
        except Exception as err:
            log.exception("sample call %s failed", call.id)
            msg = f"{type(err).__name__}: {err}"
            reply = ApiReply(id=new_id(), call_id=call.id, ok=False, error=msg, category="server", body={})
        self.server.reply(identity, reply)

    async def _use_weights(self, weights: str) -> None:
        """Hold the engine on ``weights`` (a directory of safetensors; "" = the base model) for one call."""
        async with self.switch:
            if weights != self.weights:
                while self.in_flight:
                    await asyncio.sleep(0.005)
                self.version += 1
                source = weights or str(Path(resolve_model_path(self.cfg.model.path)))
                await self.engine.load_weights_from_path(self.version, source)
                self.weights = weights
            self.in_flight += 1

    async def _sample(self, call: ApiCall) -> dict:
        if call.op != "sample":
            raise ValueError(f"a sampler runs sample calls, not {call.op!r}")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        b = call.body
        prompt = [int(t) for t in call.token_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        sp = b.get("sampling_params") or {}
        stop = sp.get("stop")
        stop = [stop] if isinstance(stop, (str, int)) else list(stop or [])
        want_prompt_lp = bool(b.get("prompt_logprobs"))
        params = SamplingParams(
            n=int(b.get("num_samples", 1)),
            max_tokens=int(sp.get("max_tokens") or 16),
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=int(sp.get("top_k", -1)),
            seed=sp.get("seed"),
            stop=[s for s in stop if isinstance(s, str)] or None,
            stop_token_ids=[s for s in stop if isinstance(s, int)] or None,
            logprobs=0,
            prompt_logprobs=0 if want_prompt_lp else None,
            detokenize=any(isinstance(s, str) for s in stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        await self._use_weights(str(b.get("weights_dir") or ""))
        try:
            final = None
            async for out in self.engine._require().generate(TokensPrompt(prompt_token_ids=prompt), params, call.id):
                final = out
        finally:
            self.in_flight -= 1
        if final is None:
            raise RuntimeError("vLLM returned no output")
        sequences = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            toks = list(c.token_ids)
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(toks)] if c.logprobs else []
            reason = "length" if c.finish_reason == "length" else "stop"
            sequences.append({"tokens": toks, "logprobs": lps, "stop_reason": reason})
        body: dict = {"sequences": sequences}
        if want_prompt_lp and final.prompt_logprobs is not None:
            body["prompt_logprobs"] = [
                None if d is None else float(d[prompt[i]].logprob) for i, d in enumerate(final.prompt_logprobs)
            ]
        return body

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.close()
        if getattr(self, "engine", None) is not None:
            self.loop.run_until_complete(self.engine.close())
        super().close()


if __name__ == "__main__":
    raise SystemExit(component_main(SamplerApiProc))
