"""``python -m exporter stream``: a Kafka consumer group scoring each event through a guarded
model on Triton gRPC, results to an output topic, refusals to a dead-letter topic, offsets
committed only behind acknowledged results (at-least-once; docs/streams.md)."""
