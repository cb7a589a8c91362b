// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Socket-level service translation (Cilium's bpf_sock.c, IPv4): cgroup v2 hooks that turn a
 * pod's connect()/sendmsg() to a ClusterIP:port into one ready backend before any packet
 * exists, so the egress policy of from_container judges the backend's identity and port.
 * UDP replies are reverse-translated (recvmsg, getpeername) so the pod sees the ClusterIP.
 *
 *   lb4_services  frontend+slot -> service id, backend count (slot 0) or backend id (1..n)
 *   lb4_backends  backend id -> address, port
 *   lb4_revnat    (socket cookie, backend) -> frontend, for UDP
 *   lb_ids        the next service and backend ids (never reused)
 *
 * A frontend with no ready backend fails the call (the hook returns 0: EPERM), so nothing is
 * sent to the ClusterIP where the policy would judge it as `world`. Maps are pinned by name
 * under <bpf-root>/ciliate/ and the links under the same directory: translation goes on while
 * the agent is stopped.
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>

#include "services.h"
#include "lib/pinned.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Instances that only exist so the skeleton generates Rust definitions of these types. */
struct lb4_key _abi_lb4_key = {};
struct lb4_service _abi_lb4_service = {};
struct lb4_backend _abi_lb4_backend = {};
struct lb4_revnat_key _abi_lb4_revnat_key = {};
struct lb4_revnat_value _abi_lb4_revnat_value = {};
struct lb_ids _abi_lb_ids = {};

PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_LB_SERVICES_MAX, struct lb4_key, struct lb4_service, 0) lb4_services SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_LB_BACKENDS_MAX, __u32, struct lb4_backend, 0) lb4_backends SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, CILIATE_LB_REVNAT_MAX, struct lb4_revnat_key, struct lb4_revnat_value, 0) lb4_revnat SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, struct lb_ids, 0) lb_ids SEC(".maps");

#define SYS_REJECT 0
#define SYS_PROCEED 1

/* Translates ctx's destination when it is a frontend. Returns SYS_REJECT for a frontend
 * without a usable backend (fail closed), SYS_PROCEED otherwise. */
static __always_inline int lb4_translate(struct bpf_sock_addr *ctx, int udp_revnat)
{
	__u32 proto = ctx->protocol;
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return SYS_PROCEED;
	struct lb4_key key = {};
	key.address = ctx->user_ip4;
	key.dport = (__u16)ctx->user_port;
	key.proto = (__u8)proto;
	struct lb4_service *svc = bpf_map_lookup_elem(&lb4_services, &key);
	if (!svc)
		return SYS_PROCEED;
	__u16 count = svc->count;
	__u32 service_id = svc->service_id;
	if (count == 0)
		return SYS_REJECT;
	key.backend_slot = (bpf_get_prandom_u32() % count) + 1;
	struct lb4_service *slot = bpf_map_lookup_elem(&lb4_services, &key);
	if (!slot)
		return SYS_REJECT;
	struct lb4_backend *be = bpf_map_lookup_elem(&lb4_backends, &slot->backend_id);
	if (!be)
		return SYS_REJECT;
	if (udp_revnat && proto == IPPROTO_UDP) {
		struct lb4_revnat_key rk = {};
		rk.cookie = bpf_get_socket_cookie(ctx);
		rk.address = be->address;
		rk.port = be->port;
		struct lb4_revnat_value rv = {};
		rv.address = ctx->user_ip4;
		rv.port = (__u16)ctx->user_port;
		rv.service_id = service_id;
		/* Without the entry the reply would show the backend: refuse rather than confuse. */
		if (bpf_map_update_elem(&lb4_revnat, &rk, &rv, BPF_ANY) != 0)
			return SYS_REJECT;
	}
	ctx->user_ip4 = be->address;
	ctx->user_port = be->port;
	return SYS_PROCEED;
}

/* Where a UDP datagram came from (or the socket's peer), shown as the frontend it was sent to. */
static __always_inline void lb4_reverse(struct bpf_sock_addr *ctx)
{
	struct lb4_revnat_key rk = {};
	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.address = ctx->user_ip4;
	rk.port = (__u16)ctx->user_port;
	struct lb4_revnat_value *rv = bpf_map_lookup_elem(&lb4_revnat, &rk);
	if (!rv)
		return;
	ctx->user_ip4 = rv->address;
	ctx->user_port = rv->port;
}

SEC("cgroup/connect4")
int sock4_connect(struct bpf_sock_addr *ctx)
{
	return lb4_translate(ctx, 1);
}

SEC("cgroup/sendmsg4")
int sock4_sendmsg(struct bpf_sock_addr *ctx)
{
	return lb4_translate(ctx, 1);
}

SEC("cgroup/recvmsg4")
int sock4_recvmsg(struct bpf_sock_addr *ctx)
{
	lb4_reverse(ctx);
	return SYS_PROCEED;
}

SEC("cgroup/getpeername4")
int sock4_getpeername(struct bpf_sock_addr *ctx)
{
	lb4_reverse(ctx);
	return SYS_PROCEED;
}
