"""broadcaster.bus_method / bus_fetch: weights as frames over real ZeroMQ sockets.

A real `BusSender` (ROUTER + server thread) and a real `BusFetcher` (DEALER) in the test process
move real tensors: exact round trip in the wire dtype, buffers reused across versions, an old
version answered with the latest, a fetcher that asks before anything is served, tcp:// with
CurveZMQ. A hand-written server (the same wire messages, one frame damaged and one truncated)
checks that the receiver counts a bad frame, drops it and asks again.
"""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from broadcaster.bus_fetch import BusFetcher, bucket_checksum
from broadcaster.bus_method import BusLink, BusSender
from broadcaster.buckets import BucketReceiver
from broadcaster.factory import build_receiver, build_senders
from broadcaster.manifest import build_manifest, plan_buckets
from bus import auth
from bus.codec import decode, encode
from bus.messages_weights import WeightsBucket, WeightsRequest
from busctl.components.table import free_port
from configs.schema import BroadcastConfig

BUCKET_BYTES = 256 * 1024  # several buckets of > 64 KiB: pyzmq sends them zero-copy


def _payload(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 256, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(512, 256, generator=gen),
        "model.norm.weight": torch.randn(256, generator=gen),
        "model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 256, generator=gen),
        "model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(256, 4, generator=gen),
        "model.layers.0.self_attn.q_proj.lora_scaling": torch.tensor(2.0),
    }  # an adapter payload (its factors stay float32 on the wire) with whole weights beside it


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    auth.disable(context)
    context.term()


def _fetch(address: str, manifest, version: int, **kwargs):
    fetcher = BusFetcher(address, producer="producer-0", retry_s=0.5, **kwargs)
    try:
        buffers = BucketReceiver(manifest, BUCKET_BYTES)
        return fetcher.fetch(buffers, version, timeout_s=60), buffers
    finally:
        fetcher.close()


def _assert_received(views: dict[str, torch.Tensor], state: dict[str, torch.Tensor], manifest) -> None:
    assert list(views) == [name for name, _, _ in manifest]
    for name, dtype, _ in manifest:
        assert views[name].dtype == getattr(torch, dtype)
        assert torch.equal(views[name], state[name].to(views[name].dtype)), name


def test_versions_round_trip_in_the_wire_dtype_through_reused_buffers(tmp_path, ctx):
    address = f"ipc://{tmp_path}/weights"
    sender = BusSender(ctx, address, bucket_bytes=BUCKET_BYTES)
    try:
        sender.open()
        for version in (1, 2):
            state = _payload(version)
            manifest = build_manifest(state, dtype=torch.bfloat16)
            info = sender.start_send(state, version, manifest)
            assert info["method"] == "bus" and info["path"] is None and info["bucket_bytes"] == BUCKET_BYTES
            if version == 1:
                first = [flat.data_ptr() for flat in sender.buffers.flats]
            result, buffers = _fetch(address, manifest, version)
            assert result.version == version and result.rejected == {}
            assert result.num_bytes == info["num_bytes"] == buffers.num_bytes
            assert len(buffers.buckets) > 2
            _assert_received(result.views, state, manifest)
        assert [flat.data_ptr() for flat in sender.buffers.flats] == first  # one version's buffers, refilled
    finally:
        sender.close()


def test_a_request_for_an_old_version_gets_the_latest(tmp_path, ctx):
    address = f"ipc://{tmp_path}/weights"
    sender = BusSender(ctx, address, bucket_bytes=BUCKET_BYTES)
    try:
        for version in (1, 2, 3):
            state = _payload(version)
            sender.start_send(state, version)
        result, _ = _fetch(address, build_manifest(state), 1)
        assert result.version == 3
        _assert_received(result.views, state, build_manifest(state))
    finally:
        sender.close()


def test_a_receiver_that_asks_before_anything_is_served_gets_the_first_version(tmp_path, ctx):
    address = f"ipc://{tmp_path}/weights"
    state = _payload(0)
    manifest = build_manifest(state)
    results: list = []
    fetching = threading.Thread(target=lambda: results.append(_fetch(address, manifest, 0)))
    fetching.start()  # connects before the trainer binds, asks before a version is served
    sender = BusSender(ctx, address, bucket_bytes=BUCKET_BYTES)
    try:
        sender.open()
        sender.start_send(state, 0, manifest)
        fetching.join(timeout=60)
        assert not fetching.is_alive()
        ((result, _),) = results
        _assert_received(result.views, state, manifest)
    finally:
        sender.close()


def test_tcp_with_curve_keys(tmp_path, ctx):
    keys_dir = tmp_path / "keys"
    auth.create_keys(keys_dir)
    auth.enable(ctx, auth.CurveKeys.load(keys_dir))
    address = f"tcp://127.0.0.1:{free_port()}"
    sender = BusSender(ctx, address, bucket_bytes=BUCKET_BYTES)
    state = _payload(5)
    try:
        sender.start_send(state, 7)
        link = BusLink.connecting(address, auth.CurveKeys.load(keys_dir))
        result, _ = _fetch(address, build_manifest(state), 7, keys_dir=link.keys_dir, client=link.client)
        assert result.version == 7 and result.rejected == {}
        _assert_received(result.views, state, build_manifest(state))
    finally:
        sender.close()


def test_a_damaged_or_truncated_frame_is_counted_dropped_and_asked_again(tmp_path, ctx):
    """A server of the test's own answers the first request for bucket 0 with one byte flipped and
    the first for bucket 1 cut short; the receiver must end with the true bytes of both."""
    state = _payload(3)
    manifest = build_manifest(state)
    buckets = plan_buckets(manifest, BUCKET_BYTES)
    flats = [torch.cat([state[e.name].reshape(-1).to(b.dtype) for e in b.entries]) for b in buckets]
    arrays = [flat.view(torch.uint8).numpy() for flat in flats]
    address = f"ipc://{tmp_path}/weights"
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    stop = threading.Event()

    def serve() -> None:
        damaged = set()
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, *frames = router.recv_multipart()
            request = decode(frames)
            assert isinstance(request, WeightsRequest)
            for index in request.buckets:
                data = arrays[index]
                header, payload = encode(
                    WeightsBucket(
                        id=str(index),
                        version=4,
                        index=index,
                        num_buckets=len(arrays),
                        bucket_bytes=BUCKET_BYTES,
                        crc32=bucket_checksum(data),
                        data=data,
                    )
                )
                payload = bytes(payload)
                if index == 0 and 0 not in damaged:
                    payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
                elif index == 1 and 1 not in damaged:
                    payload = payload[:-10]
                damaged.add(index)
                router.send_multipart([identity, header, payload])

    server = threading.Thread(target=serve)
    server.start()
    try:
        result, _ = _fetch(address, manifest, 4)
    finally:
        stop.set()
        server.join()
        router.close(linger=0)
    assert result.rejected == {"checksum": 1, "size": 1}
    assert result.version == 4
    _assert_received(result.views, state, manifest)


def test_the_factory_builds_the_bus_method_and_the_bus_fallback(tmp_path, ctx):
    link = BusLink(f"ipc://{tmp_path}/weights", ctx)
    sender, fallback = build_senders(BroadcastConfig(method="bus"), world_size=2, out_dir=tmp_path, bus=link)
    assert isinstance(sender, BusSender) and fallback is None
    sender, fallback = build_senders(
        BroadcastConfig(method="broadcast", fallback="bus"), world_size=2, out_dir=tmp_path, bus=link
    )
    assert sender.method == "broadcast" and isinstance(fallback, BusSender)
    sender, fallback = build_senders(
        BroadcastConfig(fallback="bus"), world_size=2, out_dir=tmp_path, restarted=True, bus=link
    )
    assert isinstance(sender, BusSender) and fallback is sender  # until a re-formed group replaces it
    receiver = build_receiver(
        BroadcastConfig(fallback="bus"),
        object(),
        rank=1,
        world_size=2,
        in_group=False,
        name="producer-0",
        bus=BusLink.connecting(link.address, None),
    )
    assert receiver.method == "broadcast" and receiver.fallback.method == "bus"
    with pytest.raises(ValueError, match="bus=BusLink"):
        build_senders(BroadcastConfig(method="bus"), world_size=2, out_dir=tmp_path)
