// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* IPv4 service translation at the socket (Cilium's lb4 half of lib/lb.h and bpf_sock.c): the
 * frontend, backend and UDP reverse-translation tables, the translation of a destination and
 * the reverse translation of a UDP peer. lib/lb6.h is its IPv6 counterpart, and uses this one
 * for IPv4-mapped IPv6 addresses (an IPv6 socket talking IPv4). */
#ifndef CILIATE_LIB_LB4_H
#define CILIATE_LIB_LB4_H

/* What a translation found. */
#define LB_NONE 0       /* not a frontend: the call goes on untouched */
#define LB_REJECT 1     /* a frontend without a usable backend: the call fails */
#define LB_TRANSLATED 2 /* the destination is now a backend */

PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_LB_SERVICES_MAX, struct lb4_key, struct lb4_service, 0) lb4_services SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_LB_BACKENDS_MAX, __u32, struct lb4_backend, 0) lb4_backends SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, CILIATE_LB_REVNAT_MAX, struct lb4_revnat_key, struct lb4_revnat_value, 0) lb4_revnat SEC(".maps");

static __always_inline int lb_proto_translated(__u32 proto)
{
	return proto == IPPROTO_TCP || proto == IPPROTO_UDP;
}

/* Picks a backend of the frontend (*address, *port) of `proto` and writes it there; for UDP,
 * records the socket's reverse translation first. Network byte order throughout. */
static __always_inline int lb4_xlate(struct bpf_sock_addr *ctx, __u32 proto, __u32 *address,
				     __u32 *port)
{
	struct lb4_key key = {};
	key.address = *address;
	key.dport = (__u16)*port;
	key.proto = (__u8)proto;
	struct lb4_service *svc = bpf_map_lookup_elem(&lb4_services, &key);
	if (!svc)
		return LB_NONE;
	__u16 count = svc->count;
	__u32 service_id = svc->service_id;
	if (count == 0)
		return LB_REJECT;
	key.backend_slot = (bpf_get_prandom_u32() % count) + 1;
	struct lb4_service *slot = bpf_map_lookup_elem(&lb4_services, &key);
	if (!slot)
		return LB_REJECT;
	struct lb4_backend *be = bpf_map_lookup_elem(&lb4_backends, &slot->backend_id);
	if (!be)
		return LB_REJECT;
	if (proto == IPPROTO_UDP) {
		struct lb4_revnat_key rk = {};
		rk.cookie = bpf_get_socket_cookie(ctx);
		rk.address = be->address;
		rk.port = be->port;
		struct lb4_revnat_value rv = {};
		rv.address = *address;
		rv.port = (__u16)*port;
		rv.service_id = service_id;
		/* Without the entry the reply would show the backend: refuse rather than confuse. */
		if (bpf_map_update_elem(&lb4_revnat, &rk, &rv, BPF_ANY) != 0)
			return LB_REJECT;
	}
	*address = be->address;
	*port = be->port;
	return LB_TRANSLATED;
}

/* Translates ctx's destination when it is a frontend. Returns SYS_REJECT for a frontend
 * without a usable backend (fail closed), SYS_PROCEED otherwise. */
static __always_inline int lb4_translate(struct bpf_sock_addr *ctx)
{
	__u32 proto = ctx->protocol;
	if (!lb_proto_translated(proto))
		return SYS_PROCEED;
	__u32 address = ctx->user_ip4;
	__u32 port = ctx->user_port;
	int r = lb4_xlate(ctx, proto, &address, &port);
	if (r == LB_REJECT)
		return SYS_REJECT;
	if (r == LB_TRANSLATED) {
		ctx->user_ip4 = address;
		ctx->user_port = port;
	}
	return SYS_PROCEED;
}

/* The frontend a UDP peer (*address, *port) of this socket stands for, written there.
 * Returns whether there was one. */
static __always_inline int lb4_unxlate(struct bpf_sock_addr *ctx, __u32 *address, __u32 *port)
{
	struct lb4_revnat_key rk = {};
	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.address = *address;
	rk.port = (__u16)*port;
	struct lb4_revnat_value *rv = bpf_map_lookup_elem(&lb4_revnat, &rk);
	if (!rv)
		return 0;
	*address = rv->address;
	*port = rv->port;
	return 1;
}

/* Where a UDP datagram came from (or the socket's peer), shown as the frontend it was sent to. */
static __always_inline void lb4_reverse(struct bpf_sock_addr *ctx)
{
	__u32 address = ctx->user_ip4;
	__u32 port = ctx->user_port;
	if (lb4_unxlate(ctx, &address, &port)) {
		ctx->user_ip4 = address;
		ctx->user_port = port;
	}
}

#endif /* CILIATE_LIB_LB4_H */
