"""`unbroken k8s`: Kubernetes manifests for a fault-tolerant training job.

`spec` (what is asked, validated), `names` (what objects are called), `policy` (the exit-code table as Job and JobSet failure
policies), `pod` (the pod template every workload shares), `jobset`, `trainer`,
`pytorchjob`, `etcd`, `observability` (the objects), `render` (apply order, YAML, files).
docs/kubernetes.md describes the objects and the exit-code table.
"""
