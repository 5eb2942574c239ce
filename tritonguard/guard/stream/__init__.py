"""The guard in front of a decoupled (streaming) generative model: its settings (config), its
services and stage list (services), its calls of the target (target), one generation's stream to
the client (forwarder), and the Triton model that runs them (model).

May import: the guard plane's pipeline, stages and routing; generation (the vLLM contract, the
in-process generator); privacy, rollout, observe, triton; core."""
