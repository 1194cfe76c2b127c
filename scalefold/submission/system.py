"""The system description of a submission (``<submitter>/systems/<system>.json``): every field the HPC
v3.0 system-description checker (``mlperf_logging.system_desc_checker``) requires, filled from what the
runs recorded (their MLPerf logs' node and accelerator counts, ``provenance.json``: processor, memory,
accelerators, operating system, the software actually imported) and from the submitter's own file
(``--system-json``, which wins field by field). A field neither can fill is left empty and named.

(``mlperf-sysinfo`` captures such a file too, but has no HPC profile and collects through the
``mlc-scripts`` automation; a run's own record of its machine needs neither.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalefold.errors import require_file
from scalefold.submission.runs import RunLog, SubmissionError

#: the fields ``system_desc_checker.check_system_desc`` requires (mlperf-logging, hpc 3.0.0), in its order
REQUIRED_FIELDS = (
    "submitter", "division", "status", "system_name", "number_of_nodes", "host_processors_per_node",
    "host_processor_model_name", "host_processor_core_count", "host_processor_vcpu_count",
    "host_processor_frequency", "host_processor_caches", "host_processor_interconnect", "host_memory_capacity",
    "host_storage_type", "host_storage_capacity", "host_networking", "host_networking_topology",
    "host_memory_configuration", "accelerators_per_node", "accelerator_model_name",
    "accelerator_host_interconnect", "accelerator_frequency", "accelerator_on-chip_memories",
    "accelerator_memory_configuration", "accelerator_memory_capacity", "accelerator_interconnect",
    "accelerator_interconnect_topology", "cooling", "hw_notes", "framework", "other_software_stack",
    "operating_system", "sw_notes",
)  # fmt: skip
#: fields that may stay empty without a word (notes)
OPTIONAL_EMPTY = ("hw_notes", "sw_notes")


def read_system_json(path: Path) -> dict[str, Any]:
    """The submitter's ``--system-json``: a JSON object."""
    path = require_file(path, "--system-json", "a JSON system description")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise SubmissionError(f"--system-json {path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise SubmissionError(f"--system-json {path}: expected a JSON object of system-description fields")
    return data


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def detected_fields(runs: list[RunLog]) -> dict[str, Any]:
    """What the runs say about the machine: node and accelerator counts from the first MLPerf log, the rest
    from the first ``provenance.json``."""
    init = runs[0].init
    prov = next((run.provenance for run in runs if run.provenance), None) or {}
    hw, sw, code = prov.get("hardware") or {}, prov.get("software") or {}, prov.get("code") or {}
    accelerators = int(init.get("accelerators_per_node") or 0)
    fields: dict[str, Any] = {
        "number_of_nodes": _text(init.get("number_of_nodes")),
        "accelerators_per_node": str(accelerators),
        "host_processors_per_node": _text(hw.get("host_processors_per_node")),
        "host_processor_model_name": _text(hw.get("host_processor_model_name")),
        "host_processor_core_count": _text(hw.get("host_processor_core_count")),
        "host_processor_vcpu_count": _text(hw.get("host_processor_vcpu_count")),
        "host_memory_capacity": f"{hw['host_memory_gib']:g} GiB" if hw.get("host_memory_gib") else "",
        "operating_system": _text(hw.get("operating_system")),
        "framework": f"PyTorch {sw['torch']}" if sw.get("torch") else "",
    }
    if accelerators == 0:  # a CPU system: no accelerator to describe
        fields.update({name: "none" for name in REQUIRED_FIELDS if name.startswith("accelerator_")})
        fields["accelerator_model_name"] = "none (CPU)"
    else:
        fields["accelerator_model_name"] = _text(hw.get("accelerator_model_name"))
        gib = hw.get("accelerator_memory_gib")
        fields["accelerator_memory_capacity"] = f"{gib:g} GiB" if gib else ""
    stack = {k: v for k, v in sw.items() if k != "torch"}
    if code:
        stack["scalefold"] = code.get("scalefold_version")
        if code.get("git_commit"):
            stack["scalefold_git_commit"] = code["git_commit"]
    if hw.get("kernel"):
        stack["kernel_version"] = hw["kernel"]
    fields["other_software_stack"] = stack
    return fields


def system_description(runs: list[RunLog], submitter: str, system: str, division: str,
                       given: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """(the description, the required fields left empty): the submitter's and division, the detected fields,
    then ``given`` (``--system-json``) over them field by field."""
    desc: dict[str, Any] = {name: "" for name in REQUIRED_FIELDS}
    desc.update({"submitter": submitter, "division": division, "system_name": system})
    desc.update({k: v for k, v in detected_fields(runs).items() if v not in ("", None, {})})
    if not desc["other_software_stack"]:
        desc["other_software_stack"] = {}
    desc.update(given or {})
    for key in ("submitter", "division"):
        if desc[key] != {"submitter": submitter, "division": division}[key]:
            raise SubmissionError(f"--system-json says {key} {desc[key]!r} but the package is for "
                                  f"--{key} {({'submitter': submitter, 'division': division})[key]!r}")  # fmt: skip
    missing = [name for name in REQUIRED_FIELDS if name not in OPTIONAL_EMPTY and desc.get(name) in ("", None, {})]
    return desc, missing
