"""The rollout producer process: prompts in, one :class:`bus.messages.RolloutGroup` per prompt out, on one vLLM engine.

:class:`ProducerProc` runs asyncio tasks on one event loop. The prompt loop takes prompts while fewer than
``max_concurrent_groups * group_size`` samples are in flight (an eval group counts its own size); a prefetched
training prompt is held until the applied policy version admits it. One generation task per prompt samples the group
(plain, as multi-turn episodes, :mod:`producers.episodes`, or as agent calls against the OpenAI-compatible endpoint,
:mod:`producers.endpoint`), scores it under the teacher if any and sends it on ``rollouts/i``; a group that raises
is announced as ``groups.dropped`` so a replacement is issued. The control loop applies ``weights.ready`` through the
receiver of :mod:`broadcaster.factory` and announces ``weights.applied``, or moves to a re-formed weight group. Eval
groups are sampled under one version (:class:`producers.eval_gate.EvalUpdateGate`). The stories: docs/ARCHITECTURE.md
("Pace, staleness and accounting", "Weights", "Producer side", "Multi-turn episodes").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from broadcaster.bus_method import BusLink
from broadcaster.factory import build_receiver
from bus import auth
from bus.component import Component, component_main, exit_now
from bus.messages import (
    EvalResult,
    GroupsDropped,
    Prompt,
    RolloutGroup,
    RunDone,
    ServersScaled,
    ServersWanted,
    WeightsApplied,
    WeightsReady,
    WeightsWanted,
    new_id,
)
from bus.messages_weights import WeightGroup, WeightGroupAck
from telemetry.failure_window import FailureWindows
from telemetry.metrics import POLICY_VERSION, StageMeter
from bus.sample_arrays import pack_spans, run_lengths
from bus.wire import is_chat_messages
from producers.agents import AgentRunner
from producers.endpoint import OpenAIEndpoint
from producers.engines import build_engine
from producers.episodes import EpisodeRunner
from producers.eval_gate import EvalRoundHold, EvalUpdateGate
from producers.sampling import request_kwargs
from producers.teacher import Teacher
from tasks.env import EnvCalls
from tasks.registry import env_tasks, eval_tasks, task_agent

log = logging.getLogger(__name__)

GROUPS_OUT = Counter("rlbus_producer_groups_total", "Groups generated")
GROUPS_FAILED = Counter(
    "rlbus_producer_groups_failed_total", "Groups whose generation raised (replaced; the error is in the log)"
)
TOKENS_OUT = Counter("rlbus_producer_completion_tokens_total", "Completion tokens generated")
GEN_SECONDS = Histogram("rlbus_producer_group_seconds", "Time to generate one group, seconds")
UPDATE_SECONDS = Histogram("rlbus_producer_weight_update_seconds", "Pause + load + resume per weight update, seconds")
UPDATE_LAST_SECONDS = Gauge(
    "rlbus_producer_weight_update_last_seconds",
    "Pause + load + resume of the last weight update, seconds (its version: rlbus_policy_version)",
)
UPDATE_WAIT_SECONDS = Histogram(
    "rlbus_producer_update_eval_wait_seconds", "Time a weight update waited for in-flight eval groups, seconds"
)
TEACHER_SECONDS = Histogram("rlbus_producer_teacher_seconds", "Time to score one group under the teacher, seconds")


def group_from_samples(
    prompt: Prompt,
    prompt_ids: list[int],
    samples: list,
    texts: list[str],
    *,
    producer: str,
    gen_time_s: float,
    teacher_logprobs: np.ndarray | None = None,
    prompt_text: str = "",
    model_masks: list[list[bool]] | None = None,
    env_rewards: list[float] | None = None,
) -> RolloutGroup:
    """A :class:`RolloutGroup` of the engine's samples and their decoded ``texts`` for ``prompt``.

    ``teacher_logprobs``: ``[N] float32`` (N = the group's completion tokens) or None; episodes add per-sample
    model-token masks and env rewards. ``prompt.messages`` travel only if plain string chat messages, else ``[]``."""
    spans, counts = pack_spans(run_lengths(s.token_versions or [s.version_start] * len(s.token_ids)) for s in samples)
    return RolloutGroup(
        id=prompt.id,
        prompt_index=prompt.index,
        step=prompt.step,
        task=prompt.task,
        info=prompt.info,
        producer=producer,
        completion_texts=texts,
        finish_reasons=[str(s.finish_reason) for s in samples],
        gen_time_s=gen_time_s,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        completion_ids=np.asarray([t for s in samples for t in s.token_ids], dtype=np.int32),
        completion_lens=np.asarray([len(s.token_ids) for s in samples], dtype=np.int32),
        sampler_logprobs=np.asarray([lp for s in samples for lp in s.logprobs], dtype=np.float32),
        version_start=np.asarray([s.version_start for s in samples], dtype=np.int64),
        version_end=np.asarray([s.version_end for s in samples], dtype=np.int64),
        version_spans=spans,
        version_span_counts=counts,
        temperature=prompt.temperature,
        eval_round=prompt.eval_round,
        eval_size=prompt.eval_size,
        teacher_logprobs=np.asarray([] if teacher_logprobs is None else teacher_logprobs, dtype=np.float32),
        prompt_text=prompt_text,
        loss_mask=np.asarray([m for mask in model_masks or () for m in mask], dtype=bool),
        env_rewards=np.asarray(env_rewards or [], dtype=np.float32),
        prompt_messages=list(prompt.messages) if is_chat_messages(prompt.messages) else [],
    )


class ProducerProc(Component):
    """A rollout producer process (reliable ``prompts`` in, ``rollouts/i`` out; control SUB + PUB)."""

    def setup(self) -> None:
        cfg = self.cfg
        self.loop = asyncio.new_event_loop()
        self.engine = build_engine(cfg, self.index, self.name)  # in-process vLLM or servers (producers.engine)
        self.loop.run_until_complete(self.engine.start())
        self.tokenizer = self.engine.tokenizer
        self.teacher: Teacher | None = None
        if cfg.teacher.model_path:
            self.teacher = Teacher(
                cfg.teacher.model_path,
                max_model_len=cfg.model.max_model_len,
                kv_cache_bytes=int(cfg.teacher.kv_cache_gib * 2**30),
                seed=cfg.producers.seed + self.index,
                dtype=cfg.producers.dtype,
                fork_engine_core=True,  # set up before any torch work here, as the policy's engine (producers.engines)
            )
            self.loop.run_until_complete(self.teacher.start())
        r = cfg.rewards
        self.failures = FailureWindows(  # environment and agent episodes: busctl up warns and stops the run
            window=r.error_window, warn_fraction=r.warn_error_fraction, max_fraction=r.max_error_fraction
        )
        self.env_tasks = env_tasks(cfg)  # multi-turn tasks by name; their episodes run in self.episodes
        self.episodes: EpisodeRunner | None = None
        if self.env_tasks:
            envs = EnvCalls(
                [t.env for t in self.env_tasks.values()], timeout_s=cfg.task.env_timeout_s, num_procs=cfg.task.env_procs
            )
            self.episodes = EpisodeRunner(
                self.engine,
                self.tokenizer,
                envs,
                max_model_len=cfg.model.max_model_len,
                tools=[s for t in self.env_tasks.values() for s in t.tools or ()],
                failures=self.failures,
            )
        self.endpoint: OpenAIEndpoint | None = None  # producers.endpoint_port, or an agent task
        self.agents: AgentRunner | None = None
        port = cfg.producers.endpoint_port
        self.agent = task_agent(cfg)  # task.agent or a verifiers task's; None: none
        if port is not None or self.agent:
            self.endpoint = OpenAIEndpoint(
                self.engine,
                self.tokenizer,
                max_model_len=cfg.model.max_model_len,
                host=cfg.producers.endpoint_host,
                port=port + self.index if port else 0,
                keys_file=cfg.producers.endpoint_api_keys_file,
            )
            self.loop.run_until_complete(self.endpoint.start())
        if self.agent:
            self.agents = AgentRunner(
                self.endpoint,
                [self.agent],
                timeout_s=cfg.task.agent_timeout_s,
                num_procs=cfg.task.env_procs,
                failures=self.failures,
            )
        self.gate = EvalUpdateGate()
        hold_s = min(cfg.eval.timeout_s, cfg.broadcast.timeout_s / 2)  # a held broadcast must not time out
        rounds = cfg.eval.round_versions(cfg.trainer.max_steps) if not cfg.eval.only else []
        self.round_hold = EvalRoundHold(rounds, {t.name for t in eval_tasks(cfg)} if rounds else set(), hold_s)
        launch = self.launch  # a restarted or resumed producer: its first version's round may be a re-run
        self._forget_first_round = bool(launch.restarts or launch.resume or launch.joins_late)
        self._deferred: list[object] = []  # control messages read while an update was held
        self.meter = StageMeter("producer")
        self.prompts = self.reliable_receiver(
            "prompts", self.endpoints.address("prompts"), bind=False, accept=(Prompt,)
        )
        self.rollouts = self.reliable_sender("rollouts", self.endpoints.address("rollouts", self.index), bind=True)
        self.control_in = self.control_subscriber()
        self.control_out = self.control_publisher()
        self.outcomes = self.open_outcomes()
        self.late_joiner = self.launch.joins_late
        self.receiver = build_receiver(
            cfg.broadcast,
            self.engine,
            rank=1 + self.index,
            world_size=1 + cfg.producers.replicas,
            in_group=not self.late_joiner,
            name=self.name,
            bus=BusLink.connecting(self.endpoints.address("weights"), auth.keys_from_config(cfg.bus)),
        )
        self.loop.run_until_complete(self.receiver.join())

    def run(self) -> None:
        self.loop.run_until_complete(self._run())

    async def _run(self) -> None:
        self.inflight: dict[asyncio.Task, int] = {}  # generation task -> its group's samples (the budget)
        self.held: set[asyncio.Task] = set()  # prefetched training prompts waiting for their version
        self.version_applied = asyncio.Condition()
        self.resizing: tuple[str, asyncio.Task] | None = None  # (request id, task) of busctl scale servers=N
        tasks = [asyncio.create_task(self._control_loop()), asyncio.create_task(self._prompt_loop())]
        finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        resizing = [self.resizing[1]] if self.resizing is not None else []
        for task in [*tasks, *self.inflight, *self.held, *resizing]:
            task.cancel()
        await asyncio.gather(*tasks, *self.inflight, *self.held, *resizing, return_exceptions=True)
        for task in finished:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # e.g. a broken engine: exit, the supervisor restarts us

    async def _prompt_loop(self) -> None:
        budget = self.cfg.producers.max_concurrent_groups * self.cfg.producers.group_size
        while not self.stop.is_set():
            if sum(self.inflight.values()) >= budget:  # samples in flight
                await asyncio.sleep(0.01)
                continue
            for prompt in await asyncio.to_thread(self._take_prompts, budget - sum(self.inflight.values())):
                if self._held_back(prompt):
                    held = asyncio.create_task(self._hold(prompt))
                    self.held.add(held)
                    held.add_done_callback(self.held.discard)
                else:
                    self._start(prompt)

    def _take_prompts(self, room: int) -> list[Prompt]:
        """(Worker thread.) The next prompt (up to 0.2 s), then every one already received while ``room`` samples
        are left, so a burst reaches vLLM as one batch; the last may exceed ``room``."""
        taken: list[Prompt] = []
        prompt = self.prompts.recv(0.2)
        while prompt is not None:
            taken.append(prompt)
            room -= request_kwargs(self.cfg, prompt)["n"]
            prompt = self.prompts.recv(0) if room > 0 else None
        return taken

    def _start(self, prompt: Prompt) -> None:
        task = asyncio.create_task(self._generate(prompt))
        self.inflight[task] = request_kwargs(self.cfg, prompt)["n"]
        task.add_done_callback(self.inflight.pop)  # done, failed or cancelled: its budget is free

    def _held_back(self, prompt: Prompt) -> bool:
        """A prefetched training prompt whose step the engine's policy version does not admit yet."""
        return not prompt.is_eval and self.engine.version < prompt.step - self.cfg.max_async_level

    async def _hold(self, prompt: Prompt) -> None:
        """Wait until the applied version admits ``prompt``, then start it (cancelled when the run stops)."""
        async with self.version_applied:  # every version change goes through _apply, which notifies
            await self.version_applied.wait_for(lambda: not self._held_back(prompt))
        self._start(prompt)

    async def _generate(self, prompt: Prompt) -> None:
        """Generate one group; a failure is counted and announced (the prompt is replaced)."""
        try:
            await self._generate_group(prompt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            GROUPS_FAILED.inc()
            log.error(
                "group %s failed: %s: %s; announcing it so a replacement is issued", prompt.id, type(exc).__name__, exc
            )
            msg = GroupsDropped(id=new_id(), group_ids=[prompt.id], reason=f"failed: {type(exc).__name__}")
            self.control_out.send(msg)
            # custody of the prompt ends once the ledger has recorded its outcome
            await asyncio.to_thread(self.outcomes.send, msg, upstream=(self.prompts, prompt.id))

    async def _generate_group(self, prompt: Prompt) -> None:
        env_task, masks, env_rewards = self.env_tasks.get(prompt.task), None, None
        tools = list(env_task.tools) if env_task is not None and env_task.tools else None  # a tool-use task's schemas
        text = self.tokenizer.apply_chat_template(
            prompt.messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        request_id = f"{self.name}-{prompt.id}"
        started = time.perf_counter()
        with self.meter.work():
            # an eval group is sampled under one policy version; a training group may span an update
            async with self.gate.eval_request() if prompt.is_eval else contextlib.nullcontext():
                if self.agents is not None and prompt.task == self.cfg.task.name:
                    example = {"messages": list(prompt.messages), "info": prompt.info, "task": prompt.task}
                    prompt_ids, samples, masks, env_rewards = await self.agents.run_group(
                        self.agent, example, prompt_ids, request_id=request_id, **request_kwargs(self.cfg, prompt)
                    )
                    text = self.tokenizer.decode(prompt_ids)  # the agent rendered its own prompt
                elif env_task is not None and self.episodes is not None:
                    samples, masks, env_rewards = await self.episodes.run_group(
                        env_task.env,
                        env_task.max_turns,
                        prompt_ids,
                        prompt.info,
                        request_id=request_id,
                        tools=tools,
                        **request_kwargs(self.cfg, prompt),
                    )
                else:
                    samples = await self.engine.generate_group(
                        prompt_ids, request_id=request_id, detokenize=False, **request_kwargs(self.cfg, prompt)
                    )  # decoded below
            elapsed = time.perf_counter() - started
            teacher_logprobs = None
            if self.teacher is not None and not prompt.is_eval:
                teacher_started = time.perf_counter()
                teacher_logprobs = await self.teacher.score_group(
                    prompt_ids, [s.token_ids for s in samples], request_id=request_id
                )
                TEACHER_SECONDS.observe(time.perf_counter() - teacher_started)
            # decode with the HF tokenizer (vLLM's own text drops invalid UTF-8 bytes)
            # (an episode keeps its turn markers: the text is the readable transcript)
            texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=masks is None) for s in samples]
            group = group_from_samples(
                prompt,
                prompt_ids,
                samples,
                texts,
                producer=self.name,
                gen_time_s=elapsed,
                teacher_logprobs=teacher_logprobs,
                prompt_text=text,
                model_masks=masks,
                env_rewards=env_rewards,
            )
        GEN_SECONDS.observe(elapsed)
        GROUPS_OUT.inc()
        tokens = int(group.completion_lens.sum())
        TOKENS_OUT.inc(tokens)
        self.meter.finished(group.group_size, tokens)
        await asyncio.to_thread(self.rollouts.send, group, upstream=(self.prompts, prompt.id))

    async def _control_loop(self) -> None:
        self._ask_for_group()
        while not self.stop.is_set():
            if self.receiver.lost_group():  # its inference server came back outside the weight group
                self._ask_for_group()
            msg = self._deferred.pop(0) if self._deferred else await asyncio.to_thread(self.control_in.recv, 0.2)
            if isinstance(msg, RunDone):
                return
            if isinstance(msg, EvalResult):
                self.round_hold.on_result(msg.round, msg.task)
            if isinstance(msg, ServersWanted):
                self._resize_servers(msg)
            elif isinstance(msg, WeightGroup):
                ack = WeightGroupAck(id=new_id(), producer=self.name, generation=msg.generation)
                await self.receiver.regroup(msg, lambda ack=ack: self.control_out.send(ack))
            elif isinstance(msg, WeightsReady) and (
                msg.version != self.engine.version or self.receiver.must_apply(msg, self.engine.version)
            ):
                reason = self.receiver.skip_reason(msg, self.engine.version)
                if reason is not None:
                    log.info(
                        "skipping %s of version %d (%s); waiting for a filesystem one", msg.method, msg.version, reason
                    )
                    self._ask_for_group(msg.version)
                    continue
                await self._apply(msg)

    def _resize_servers(self, msg: ServersWanted) -> None:
        """Resize the engine's servers in the background (after the previous request's resize), then answer."""
        previous = self.resizing
        if previous is not None and previous[0] == msg.id:
            return  # resent, or replayed by the hub

        async def resize() -> None:
            if previous is not None:
                await asyncio.gather(previous[1], return_exceptions=True)
            error = ""
            try:
                if not hasattr(self.engine, "resize"):
                    raise ValueError("this producer's engine runs in its process (producers.engine: vllm)")
                await self.engine.resize(msg.servers)
                log.info("running %d inference server(s) (busctl scale servers=%d)", msg.servers, msg.servers)
            except Exception as exc:  # answered to busctl scale; the producer keeps its servers
                log.error("resizing to %d server(s) failed: %r", msg.servers, exc)
                error = repr(exc)
            answer = ServersScaled(id=new_id(), producer=self.name, request=msg.id, servers=msg.servers, error=error)
            self.control_out.send(answer)

        self.resizing = (msg.id, asyncio.create_task(resize()))

    def _ask_for_group(self, version: int | None = None) -> None:
        """Send ``weights.wanted`` (``version``, None: the engine's) if the receiver is outside every group."""
        if self.receiver.wants_group:
            version = self.engine.version if version is None else version
            self.control_out.send(WeightsWanted(id=new_id(), producer=self.name, version=version))

    async def _hold_for_eval_round(self, new_version: int) -> None:
        """Keep the engine's version until its eval round's results are in (:class:`EvalRoundHold`), reading the
        control channel meanwhile: eval results noted, every other message kept for the control loop."""
        hold, version = self.round_hold, self.engine.version
        if self._forget_first_round:
            self._forget_first_round = False
            hold.forget_through(version)
        if not hold.holds(version, new_version):
            return
        started = time.perf_counter()
        while hold.holds(version, new_version) and time.perf_counter() - started < hold.timeout_s:
            msg = await asyncio.to_thread(self.control_in.recv, 0.2)
            if isinstance(msg, EvalResult):
                hold.on_result(msg.round, msg.task)
            elif msg is not None:
                self._deferred.append(msg)
            if self.stop.is_set():
                return
        waited = time.perf_counter() - started
        if hold.holds(version, new_version):
            log.warning("eval round %d not closed after %.0f s; applying version %d", version, waited, new_version)
            hold.forget_through(version)
        else:
            log.info("held version %d for %.3f s until eval round %d closed", new_version, waited, version)

    async def _apply(self, msg: WeightsReady) -> None:
        waited = time.perf_counter()  # the wait counted includes the hold for the version's eval round
        await self._hold_for_eval_round(msg.version)
        async with self.gate.update():  # in-flight eval groups finish under the old version first
            started = time.perf_counter()
            UPDATE_WAIT_SECONDS.observe(started - waited)
            loaded = await self.receiver.apply(msg)  # the bus method may load a newer version than announced
            version = msg.version if loaded is None else loaded
            elapsed = time.perf_counter() - started
        UPDATE_SECONDS.observe(elapsed)
        UPDATE_LAST_SECONDS.set(elapsed)
        POLICY_VERSION.set(version)
        async with self.version_applied:  # start the prefetched prompts this version admits
            self.version_applied.notify_all()
        self.control_out.send(WeightsApplied(id=new_id(), producer=self.name, version=version, apply_time_s=elapsed))
        log.info("applied policy version %d by %s in %.3f s", version, msg.method, elapsed)

    def close(self) -> None:
        if getattr(self, "episodes", None) is not None:
            self.episodes.envs.close()
        if getattr(self, "agents", None) is not None:
            self.agents.close()
        if getattr(self, "endpoint", None) is not None:
            self.loop.run_until_complete(self.endpoint.close())
        for engine in (getattr(self, "teacher", None), getattr(self, "engine", None)):
            if engine is not None:
                self.loop.run_until_complete(engine.close())
        super().close()


if __name__ == "__main__":
    exit_now(component_main(ProducerProc))  # no interpreter teardown: seconds of torch.library unregistration
