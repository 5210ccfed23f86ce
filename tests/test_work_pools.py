"""The GPU work-pool templates (infra/workpools/*.json) against Prefect's own validation (prefect 3.6.29).

The Kubernetes and Docker workers' packages (prefect-kubernetes, prefect-docker) are not installed here, so their
job-configuration models cannot be loaded. What is checked is what Prefect itself enforces for ANY base job template
and does with it:
- the server's ``WorkPoolCreate`` validator (``validate_base_job_template``: both keys, every ``{{ placeholder }}``
  of the job configuration declared as a variable), as ``prefect work-pool create --base-job-template`` runs it;
- the variables section is a valid JSON schema for Prefect's validator (``schema_tools.is_valid_schema``), its
  defaults and per-deployment job variables (``gpu_count=8``, ...) conform to it (``schema_tools.validate`` with the
  options of ``DeploymentCreate.check_valid_configuration``), and a wrong type is refused;
- the job configuration holds the fields every worker's configuration inherits (``BaseJobConfiguration``: command,
  env, labels, name), and renders with the worker's own code (``BaseJobConfiguration._get_base_config_defaults`` +
  ``templating.apply_values``, the core of ``from_template_and_values``) into GPU settings with the values' types.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
POOLS = {"gpu-k8s": ("kubernetes", "kubernetes-gpu.json"), "gpu-docker": ("docker", "docker-gpu.json")}


def _template(name: str) -> dict:
    return json.loads((ROOT / "infra" / "workpools" / POOLS[name][1]).read_text())


def _render(template: dict, values: dict) -> dict:
    from prefect.utilities.templating import apply_values
    from prefect.workers.base import BaseJobConfiguration

    variables = BaseJobConfiguration._get_base_config_defaults(template["variables"].get("properties", {}))
    variables.update(values)
    return apply_values(template=template["job_configuration"], values=variables)


@pytest.mark.parametrize("pool", list(POOLS))
def test_prefect_accepts_the_template(pool):
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.schema_tools import is_valid_schema, validate
    from prefect.workers.base import BaseJobConfiguration

    kind, _ = POOLS[pool]
    t = _template(pool)
    created = WorkPoolCreate(name=pool, type=kind, base_job_template=t)  # the API's own validator
    assert created.base_job_template == t
    is_valid_schema(t["variables"])
    props = t["variables"]["properties"]
    defaults = {k: v["default"] for k, v in props.items() if "default" in v}
    validate(defaults, t["variables"], raise_on_error=True, preprocess=True, ignore_required=True)
    validate({"gpu_count": 8, "image": "registry.example/si-trainer:1"}, t["variables"], raise_on_error=True,
             preprocess=True, ignore_required=True)  # what `prefect deployment run --job-variable` passes
    from prefect.utilities.schema_tools.validation import ValidationError

    with pytest.raises(ValidationError, match="gpu_count"):
        validate({"gpu_count": "eight"}, t["variables"], raise_on_error=True, preprocess=True, ignore_required=True)
    assert set(BaseJobConfiguration.json_template()) <= set(t["job_configuration"])


def test_an_undeclared_placeholder_is_refused_by_prefect():
    """The validator used above does refuse a template whose job configuration uses an undeclared variable."""
    from pydantic import ValidationError

    from prefect.server.schemas.actions import WorkPoolCreate

    t = _template("gpu-k8s")
    t["job_configuration"]["job_manifest"]["metadata"]["annotations"] = {"x": "{{ not_declared }}"}
    with pytest.raises(ValidationError, match="not_declared"):
        WorkPoolCreate(name="bad", type="kubernetes", base_job_template=t)


def test_kubernetes_template_renders_gpu_requests():
    job = _render(_template("gpu-k8s"), {"gpu_count": 8, "image": "registry.example/si-trainer:1"})
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and c["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert c["image"] == "registry.example/si-trainer:1"
    text = json.dumps(job)
    assert "{{" not in text  # every placeholder rendered
    assert "AWS_SECRET" not in text.upper().replace("AWS_SECRET_ACCESS_KEY=...", "")


def test_docker_template_renders_device_requests():
    job = _render(_template("gpu-docker"), {"gpu_count": 2})
    req = job["container_create_kwargs"]["device_requests"][0]
    assert req["driver"] == "nvidia" and req["count"] == 2 and req["capabilities"] == [["gpu"]]
    assert _render(_template("gpu-docker"), {})["container_create_kwargs"]["device_requests"][0]["count"] == -1
    assert "{{" not in json.dumps(job)
