"""Tools over the kernels at the model's MLPerf call sites: a unit above the model, because they build
its modules; the kernels themselves (:mod:`scalefold.kernels`) sit below it and know nothing of these.

* :mod:`scalefold.kerneltools.sites` -- the MLPerf call sites and the capture of every launch there;
* :mod:`scalefold.kerneltools.compile_report` -- ahead-of-time compiles for sm_90 / sm_80 without a
  GPU, ptxas' report, the launch-config table's check (``scalefold aot-check``);
* :mod:`scalefold.kerneltools.tune` -- ``scalefold tune-kernels``: times the launch configs and
  writes the table.
"""
