// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* IPv4 service translation at the socket (Cilium's lb4 half of lib/lb.h and bpf_sock.c): the
 * frontend, backend and UDP reverse-translation tables, the translation of a destination and
 * the reverse translation of a UDP peer. An IPv6 counterpart (lb6) mirrors it. */
#ifndef CILIATE_LIB_LB4_H
#define CILIATE_LIB_LB4_H

PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_LB_SERVICES_MAX, struct lb4_key, struct lb4_service, 0) lb4_services SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_LB_BACKENDS_MAX, __u32, struct lb4_backend, 0) lb4_backends SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, CILIATE_LB_REVNAT_MAX, struct lb4_revnat_key, struct lb4_revnat_value, 0) lb4_revnat SEC(".maps");

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

#endif /* CILIATE_LIB_LB4_H */
