# Cluster workflow on kind. Needs Docker (with BuildKit), kind and kubectl on the PATH;
# nothing here runs in CI. Typical use: make image kind-up kind-load deploy; make kind-down.

# The DaemonSet (manifests/daemonset.yaml) runs ciliate:dev; change both together.
IMAGE   ?= ciliate:dev
CLUSTER ?= ciliate
KIND    ?= kind
# Pinned to the kind cluster's context so deploy never lands in another cluster.
KUBECTL ?= kubectl --context kind-$(CLUSTER)

.PHONY: image kind-up kind-load deploy kind-down manifests hubble-certs

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
deploy: hubble-certs
	$(KUBECTL) apply -f manifests/crds
	$(KUBECTL) apply -f manifests/rbac.yaml -f manifests/configmap.yaml -f manifests/daemonset.yaml
	$(KUBECTL) -n kube-system rollout status daemonset/ciliate --timeout=300s
	$(KUBECTL) apply -f manifests/hubble-relay.yaml

# Hubble's TLS (openssl): a CA, the agents' server certificate (one for every node: the names
# *.default.hubble-grpc.cilium.io and hubble-peer.kube-system.svc) and the relay's client
# certificate, as the Secrets hubble-server-certs and hubble-relay-client-certs. Made once: an
# existing hubble-server-certs is kept (the agents trust its CA).
HUBBLE_CERTS ?= .hubble-certs
hubble-certs:
	@if $(KUBECTL) -n kube-system get secret hubble-server-certs >/dev/null 2>&1; then \
	  echo "hubble-server-certs exists: kept"; exit 0; fi; \
	set -e; mkdir -p $(HUBBLE_CERTS); cd $(HUBBLE_CERTS); \
	ec="-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"; \
	openssl req -x509 $$ec -keyout ca.key -out ca.crt -days 1095 -subj /CN=hubble-ca; \
	for who in server relay; do \
	  openssl req $$ec -keyout $$who.key -out $$who.csr -subj /CN=hubble-$$who; done; \
	echo "subjectAltName=DNS:*.default.hubble-grpc.cilium.io,DNS:hubble-peer.kube-system.svc" > server.ext; \
	echo "subjectAltName=DNS:hubble-relay.kube-system.svc" > relay.ext; \
	for who in server relay; do \
	  openssl x509 -req -in $$who.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
	    -out $$who.crt -days 365 -extfile $$who.ext; done; \
	for who in server:hubble-server-certs relay:hubble-relay-client-certs; do \
	  $(KUBECTL) -n kube-system create secret generic $${who#*:} \
	    --from-file=tls.crt=$${who%%:*}.crt --from-file=tls.key=$${who%%:*}.key \
	    --from-file=ca.crt=ca.crt --dry-run=client -o yaml | $(KUBECTL) apply -f -; done

kind-down:
	$(KIND) delete cluster --name $(CLUSTER)

# Regenerate manifests/crds/ from src/k8s/crd.rs.
manifests:
	UPDATE_MANIFESTS=1 cargo test --test manifests
