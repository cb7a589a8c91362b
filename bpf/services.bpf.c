// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Socket-level service translation (Cilium's bpf_sock.c): cgroup v2 hooks that turn a
 * pod's connect()/sendmsg() to a ClusterIP:port into one ready backend before any packet
 * exists, so the egress policy of from_container judges the backend's identity and port.
 * UDP replies are reverse-translated (recvmsg, getpeername) so the pod sees the ClusterIP.
 *
 *   lb4_services  frontend+slot -> service id, backend count (slot 0) or backend id (1..n)
 *   lb4_backends  backend id -> address, port
 *   lb4_revnat    (socket cookie, backend) -> frontend, for UDP
 *   lb6_services, lb6_backends, lb6_revnat   the same for IPv6 frontends
 *   lb_ids        the next service and backend ids (never reused)
 *
 * An IPv6 socket's IPv4-mapped destination (::ffff:a.b.c.d) is translated through the IPv4
 * tables (lib/lb6.h).
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
struct lb6_key _abi_lb6_key = {};
struct lb6_backend _abi_lb6_backend = {};
struct lb6_revnat_key _abi_lb6_revnat_key = {};
struct lb6_revnat_value _abi_lb6_revnat_value = {};
struct lb_ids _abi_lb_ids = {};

PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, struct lb_ids, 0) lb_ids SEC(".maps");

#define SYS_REJECT 0
#define SYS_PROCEED 1

#include "lib/lb4.h"
#include "lib/lb6.h"

SEC("cgroup/connect4")
int sock4_connect(struct bpf_sock_addr *ctx)
{
	return lb4_translate(ctx);
}

SEC("cgroup/sendmsg4")
int sock4_sendmsg(struct bpf_sock_addr *ctx)
{
	return lb4_translate(ctx);
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

SEC("cgroup/connect6")
int sock6_connect(struct bpf_sock_addr *ctx)
{
	return lb6_translate(ctx);
}

SEC("cgroup/sendmsg6")
int sock6_sendmsg(struct bpf_sock_addr *ctx)
{
	return lb6_translate(ctx);
}

SEC("cgroup/recvmsg6")
int sock6_recvmsg(struct bpf_sock_addr *ctx)
{
	lb6_reverse(ctx);
	return SYS_PROCEED;
}

SEC("cgroup/getpeername6")
int sock6_getpeername(struct bpf_sock_addr *ctx)
{
	lb6_reverse(ctx);
	return SYS_PROCEED;
}
