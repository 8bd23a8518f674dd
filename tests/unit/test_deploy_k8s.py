"""deploy/k8s: every object is a valid Kubernetes object (the `kubernetes` client's models take it and give back
exactly the same document, so no field is misspelt or misplaced), and the objects agree with each other and with
the syncer and learner: selectors, probe paths and ports, secret keys, the rendezvous name, exit codes."""

import inspect
import json
from pathlib import Path

import pytest
import yaml

from diloco import exits

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client is not installed: pip install kubernetes")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
MODELS = {("v1", "Service"): "V1Service", ("v1", "Secret"): "V1Secret", ("apps/v1", "StatefulSet"): "V1StatefulSet",
          ("batch/v1", "Job"): "V1Job"}


def documents() -> dict[str, dict]:
    """Every object of deploy/k8s, by "Kind/name"."""
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def deserialize(api, doc: dict, model: str):
    """The model object for `doc`, as the client builds it from an API server's JSON reply."""
    params = inspect.signature(api.deserialize).parameters
    if "content_type" in params:  # kubernetes >= 35
        return api.deserialize(json.dumps(doc), model, "application/json")

    class Response:  # older clients read the body from a response object
        data = json.dumps(doc)

    return api.deserialize(Response(), model)


@pytest.mark.parametrize("name", sorted(documents()))
def test_each_object_round_trips_through_the_kubernetes_models(name):
    doc = documents()[name]
    api = kubernetes.client.ApiClient()
    model = MODELS[(doc["apiVersion"], doc["kind"])]
    obj = deserialize(api, doc, model)  # required fields and enums are checked on the way in
    assert api.sanitize_for_serialization(obj) == doc, f"{name}: a field the {model} model does not know was dropped"


def test_the_objects_fit_together():
    docs = documents()
    assert set(docs) >= {"Secret/diloco-token", "Service/diloco-syncer", "StatefulSet/diloco-syncer", "Job/island-b",
                         "Service/island-b"}
    secret_keys = set(docs["Secret/diloco-token"]["stringData"])
    sts = docs["StatefulSet/diloco-syncer"]["spec"]
    pod = sts["template"]["spec"]
    syncer = pod["containers"][0]
    assert docs["Service/diloco-syncer"]["spec"]["selector"] == sts["selector"]["matchLabels"] == sts["template"][
        "metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in syncer["ports"]}
    assert ports == {"grpc": 50051, "http": 8080}  # what Containerfile.syncer's entry point listens on
    assert syncer["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert syncer["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert {m["mountPath"] for m in syncer["volumeMounts"]} == {"/state"}
    assert sts["volumeClaimTemplates"][0]["metadata"]["name"] == syncer["volumeMounts"][0]["name"]
    job = docs["Job/island-b"]["spec"]
    learner = job["template"]["spec"]["containers"][0]
    for container in (syncer, learner):
        for env in container["env"]:
            if "valueFrom" in env:
                ref = env["valueFrom"]["secretKeyRef"]
                assert ref["name"] == "diloco-token" and ref["key"] in secret_keys
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    assert job["template"]["spec"]["subdomain"] == "island-b" and docs["Service/island-b"]["spec"]["clusterIP"] == "None"
    script = learner["args"][0]
    assert "--master-addr=island-b-0.island-b" in script and "--syncer diloco-syncer:50051" in script
    assert exits.EXIT_FILE_ENV in script
    nodes = {e["name"]: e.get("value") for e in learner["env"]}["NODES"]
    assert int(nodes) == job["completions"]
    never_retry = job["podFailurePolicy"]["rules"][0]
    assert never_retry["action"] == "FailJob" and sorted(never_retry["onExitCodes"]["values"]) == sorted(
        [exits.USAGE, exits.REFUSED])


def test_the_round_trip_catches_a_misspelt_field():
    import copy

    doc = copy.deepcopy(documents()["StatefulSet/diloco-syncer"])
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    api = kubernetes.client.ApiClient()
    assert api.sanitize_for_serialization(deserialize(api, doc, "V1StatefulSet")) != doc
