# Cluster workflow on kind. Needs Docker (with BuildKit), kind and kubectl on the PATH;
# nothing here runs in CI. Typical use: make image kind-up kind-load deploy; make kind-down.

# The DaemonSet (manifests/daemonset.yaml) runs ciliate:dev; change both together.
IMAGE   ?= ciliate:dev
CLUSTER ?= ciliate
KIND    ?= kind
# Pinned to the kind cluster's context so deploy never lands in another cluster.
KUBECTL ?= kubectl --context kind-$(CLUSTER)

.PHONY: image kind-up kind-load deploy kind-down manifests

# Build the image (Dockerfile: release build with the eBPF datapath, slim Debian runtime).
image:
	docker build -t $(IMAGE) .

# A cluster without a default CNI: one control plane, two workers (manifests/kind-config.yaml).
kind-up:
	$(KIND) create cluster --name $(CLUSTER) --config manifests/kind-config.yaml

# Make the local image available on every kind node (no registry involved).
kind-load:
	$(KIND) load docker-image $(IMAGE) --name $(CLUSTER)

# CRDs first, so the policy kinds exist before anything refers to them; then RBAC, settings and
# the DaemonSet. kind-config.yaml is not a Kubernetes object and is not applied.
deploy:
	$(KUBECTL) apply -f manifests/crds
	$(KUBECTL) apply -f manifests/rbac.yaml -f manifests/configmap.yaml -f manifests/daemonset.yaml
	$(KUBECTL) -n kube-system rollout status daemonset/ciliate --timeout=300s

kind-down:
	$(KIND) delete cluster --name $(CLUSTER)

# Regenerate manifests/crds/ from src/k8s/crd.rs.
manifests:
	UPDATE_MANIFESTS=1 cargo test --test manifests
