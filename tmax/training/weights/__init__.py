"""Weight sync: how the learner's weights reach the inference engines after every step.

One package, one meaning per transport name (`engine.weight_transport`):

* `object_store`: learner rank 0's full weights travel as one Ray object to every engine
  actor, which writes them to a safetensors file and reloads it in every vLLM worker
  (`collective_rpc push_file`). The CPU default.
* `gloo` / `nccl`: learner rank 0 is rank 0 of a standalone process group whose other
  ranks are the engines' vLLM workers; every update is a JSON manifest (a Ray call
  argument) followed by broadcasts of packed per-dtype buckets. `nccl` is GPU to GPU
  (the default when the learner is on a GPU), `gloo` goes through host memory.

Either way the engine pauses (requests in flight stay frozen), loads, drops its prefix
cache and resumes (`engine_side`).

    transports.py    the transport names and which one a run uses
    protocol.py      the update manifest and its buckets (pure torch)
    group.py         the weight process group and its sender / receiver
    learner_side.py  learner rank 0's actor methods and `WeightSync`, the driver's side
    engine_side.py   the engine's pause -> load -> reset prefix cache -> resume
    vllm_ext.py      the vLLM worker extension that loads the weights in each worker
"""
