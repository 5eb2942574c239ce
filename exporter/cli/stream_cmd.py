"""``python -m exporter stream --bootstrap HOST:PORT --topic IN --output OUT --model NAME``:
score a Kafka topic through a guarded model on Triton gRPC (:mod:`exporter.stream.run`).

Runs until SIGTERM or Ctrl-C (then it finishes what it read, commits and leaves the group:
exit 0); exit 4 when a result was not acknowledged by the broker (nothing committed past it:
start it again), 2 on bad arguments or when the model or a topic is missing at start. Start as
many as the input topic has partitions, on any machines, with the same --group.

``--replay FILE|TOPIC:PARTITION:START-END`` (repeat): score those input events again through the
primary, write their results marked as replays, and exit (0)."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from exporter.cli.consoles import console
from exporter.cli.exits import EXIT_BAD_INPUT, EXIT_OK, EXIT_STOPPED
from exporter.errors import ExporterError

if TYPE_CHECKING:
    from exporter.stream.run import Stream

err = console(stderr=True)


# librdkafka settings the stream sets itself: its delivery guarantee (offsets committed only after
# the results are acknowledged; an idempotent producer), or an option of its own names them
OWNED = {"enable.auto.commit": "offsets are committed after the results are acknowledged",
         "enable.auto.offset.store": "offsets are committed after the results are acknowledged",
         "enable.idempotence": "the output producer is idempotent", "acks": "the output producer waits for acks=all",
         "group.id": "use --group", "bootstrap.servers": "use --bootstrap",
         "auto.offset.reset": "use --offset-reset", "session.timeout.ms": "use --session-timeout-ms"}


def _kafka_settings(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise typer.BadParameter(f"{item!r}: expected KEY=VALUE (a librdkafka setting)")
        if key in OWNED:
            raise typer.BadParameter(f"{key} is set by the stream ({OWNED[key]})")
        out[key] = value
    return out


def stream_command(
    bootstrap: Annotated[str, typer.Option(help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT].")],
    topic: Annotated[str, typer.Option(help="Input topic of events (JSON: {\"inputs\": {NAME: nested list}}).")],
    output: Annotated[str, typer.Option(help="Output topic: one result per event, the event's key.")],
    model: Annotated[str, typer.Option(help="Guarded model name, e.g. digits.")],
    url: Annotated[str, typer.Option(help="Triton gRPC address.")] = "127.0.0.1:8001",
    group: Annotated[str, typer.Option(help="Consumer group id (every process of one stream shares it).")] = "tritonguard-stream",
    dlq: Annotated[str | None, typer.Option(help="Dead-letter topic (default: OUTPUT.dlq).")] = None,
    max_batch: Annotated[int, typer.Option(min=1, help="Events read from Kafka per poll when idle.")] = 32,
    max_wait_ms: Annotated[float, typer.Option(min=0, help="Time a micro-batch waits to fill.")] = 5.0,
    max_inflight: Annotated[int, typer.Option(min=1, help="Requests at Triton at once, at most.")] = 256,
    batch_size: Annotated[int, typer.Option(min=1, help="Events in one Triton request at most (batch dimension; "
                                            "capped by the model's max_batch_size; a request holds one key's "
                                            "events).")] = 32,
    batch_wait_ms: Annotated[float, typer.Option(min=0, help="How long a request that is not full waits for more "
                                                 "events.")] = 2.0,
    read_ahead: Annotated[int, typer.Option(min=1, help="Per partition: events read and not yet acknowledged; "
                                            "the partition is paused above it (resumed at half).")] = 2000,
    read_ahead_bytes: Annotated[int, typer.Option(min=1, help="Per partition: bytes of those events' keys and "
                                                  "values; paused above it.")] = 32 * 2**20,
    partition_by: Annotated[str, typer.Option(help="Output partition: 'input' (the event's partition number, "
                                               "order kept per input partition) or 'key' (hash of the key).")] = "input",
    session_timeout_ms: Annotated[int, typer.Option(min=1000, help="Group session timeout: a consumer that died "
                                                     "loses its partitions after this long.")] = 10000,
    offset_reset: Annotated[str, typer.Option(help="Where a group without a committed offset starts: earliest "
                                               "or latest.")] = "earliest",
    metrics_port: Annotated[int | None, typer.Option(help="Serve Prometheus metrics on this port.")] = None,
    metrics_address: Annotated[str, typer.Option(help="Address of the metrics endpoint.")] = "127.0.0.1",
    kafka: Annotated[list[str] | None, typer.Option("--kafka", help="Extra librdkafka setting KEY=VALUE (repeat), "
                                                    "for both clients, e.g. security.protocol=SASL_SSL; "
                                                    "not those the delivery guarantee rests on "
                                                    "(acks, enable.idempotence, enable.auto.commit).")] = None,
    record: Annotated[str | None, typer.Option(help="JSON file kept up to date with the input offsets each "
                                               "version answered (one per process; for --replay).")] = None,
    replay: Annotated[list[str] | None, typer.Option(help="Score again through the primary the events of a "
                                                     "--record file (those a version other than the primary "
                                                     "answered) or of TOPIC:PARTITION:START-END (repeat), "
                                                     "then exit.")] = None,
    sticky: Annotated[bool, typer.Option(help="Send the event's key as the guard's routing_key: a key's events "
                                        "go to one version throughout a rollout step.")] = True,
) -> None:
    """Score every event of TOPIC through MODEL on Triton: results to OUTPUT in input order per
    partition, refused events to the dead-letter topic, offsets committed only behind results the
    broker acknowledged (at-least-once; results carry the id topic/partition/offset)."""

    from exporter.stream.answered import RecordError, read_specs  # noqa: PLC0415
    from exporter.stream.metrics import StreamMetrics  # noqa: PLC0415 - Kafka and gRPC only for this command
    from exporter.stream.run import Stream, StreamConfig  # noqa: PLC0415

    if partition_by not in ("input", "key"):
        err.print("[bold red]✗ stream failed:[/] --partition-by is 'input' or 'key'")
        raise typer.Exit(EXIT_BAD_INPUT)
    if offset_reset not in ("earliest", "latest"):
        err.print("[bold red]✗ stream failed:[/] --offset-reset is 'earliest' or 'latest'")
        raise typer.Exit(EXIT_BAD_INPUT)
    cfg = StreamConfig(bootstrap=bootstrap, topic=topic, output=output, model=model, url=url, group=group, dlq=dlq,
                       max_batch=max_batch, max_wait_ms=max_wait_ms, max_inflight=max_inflight,
                       batch_size=batch_size, batch_wait_ms=batch_wait_ms,
                       read_ahead=read_ahead, read_ahead_bytes=read_ahead_bytes,
                       partition_by=partition_by, session_timeout_ms=session_timeout_ms, offset_reset=offset_reset,
                       kafka=_kafka_settings(kafka or []), record=record, sticky=sticky)
    wanted = None
    if replay:
        try:
            wanted = read_specs(replay, topic)
        except RecordError as exc:
            err.print(f"[bold red]✗ stream failed:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
    metrics = StreamMetrics(model)
    try:
        stream = Stream(cfg, metrics)
    except ExporterError as exc:
        err.print(f"[bold red]✗ stream failed:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    if wanted is not None:
        _replay(stream, wanted)
    if metrics_port is not None:
        metrics.serve(metrics_port, metrics_address)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stream.stop.set())
    err.print(f"streaming {escape(topic)} → {escape(model)} → {escape(output)} (dead letters: "
              f"{escape(cfg.dead_letters)}), group {escape(group)}", soft_wrap=True)
    raise typer.Exit(EXIT_STOPPED if stream.run() else EXIT_OK)  # Stream.run: 1 on a fatal error


def _replay(stream: Stream, wanted: dict) -> None:
    n = sum(b - a + 1 for spans in wanted.values() for a, b, _ in spans)
    err.print(f"replaying up to {n} events of {escape(stream.cfg.topic)} through the primary → "
              f"{escape(stream.cfg.output)}", soft_wrap=True)
    try:
        counts = stream.replay(wanted)
    except ExporterError as exc:
        err.print(f"[bold red]✗ replay failed:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    finally:
        stream.close()
    err.print(f"replayed {counts['replayed']} events through the primary ({counts['skipped']} answered by it "
              f"already, {counts['dead']} dead letters)")
    raise typer.Exit(EXIT_OK)
