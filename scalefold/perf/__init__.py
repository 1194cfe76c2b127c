"""Performance planning and measurement of the training step, runnable without a GPU.

Both tools below take the Trainer's own step object (:class:`scalefold.train.step.TrainingStep`: no-grad
recycling passes, grad pass, loss, backward, clipping, Adam + SWA) on a synthetic batch of the run's
shapes, so they measure the step the Trainer takes by construction.

* :mod:`scalefold.perf.memory`     -- ``scalefold estimate-memory``: peak memory per rank predicted by
  running that step on fake tensors (shapes only), and :func:`~scalefold.perf.memory.check_fits` for
  the start-up check; with ``--sites`` by allocating line, which :mod:`scalefold.perf.memory_sites` puts
  beside a CUDA allocator trace (:mod:`scalefold.perf.cuda_snapshot`);
* :mod:`scalefold.perf.flops`      -- ``scalefold estimate-step``: the same fake step's FLOPs and bytes
  per operator, by module and recycling count (:func:`~scalefold.perf.flops.step_throughput`: a logged
  step's TFLOP/s and MFU); :mod:`scalefold.perf.devices` the GPUs' peaks and the roofline floor;
  :mod:`scalefold.perf.recompute` the activation-checkpointing policy that fits a device (``auto``);
* :mod:`scalefold.perf.comm`, :mod:`scalefold.perf.cluster`, :mod:`scalefold.perf.layout_model` -- ``scalefold
  estimate-step --dp``: each collective's bytes per rank (DAP per block and step, BP, the gradient all-reduce) on
  named cards and links, and the step at a layout (compute per card + exposed communication);
  :mod:`scalefold.perf.plan` -- ``scalefold plan``: the time to train on N cards, calibrated on NVIDIA's v3.0 runs;
* :mod:`scalefold.perf.step_bench` -- ``scalefold bench step``: the step timed eager and compiled in
  one process, with graph breaks and recompilations counted; ``--call-sites``
  (:mod:`scalefold.perf.compile_sites`): each compiled region's cost at the step's own call sites,
  recorded on the fake step and replayed, for shapes whose step is too slow to run here.
"""
