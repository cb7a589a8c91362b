// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* IPv6 service translation at the socket (Cilium's lb6 half of lib/lb.h and bpf_sock.c), the
 * counterpart of lib/lb4.h: the same tables keyed by IPv6 addresses (service values are the
 * same struct; backend ids are shared by both families), the same translation and reverse
 * translation. An IPv4-mapped destination (::ffff:a.b.c.d, an IPv6 socket talking IPv4) is
 * translated through the IPv4 tables, as Cilium's sock6_xlate_v4_in_v6 does: otherwise a
 * dual-stack socket would reach an IPv4 ClusterIP untranslated. */
#ifndef CILIATE_LIB_LB6_H
#define CILIATE_LIB_LB6_H

#include <bpf/bpf_endian.h>

/* Created on demand (the IPv4 tables are preallocated): most clusters have no IPv6 Service. */
PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_LB_SERVICES_MAX, struct lb6_key, struct lb4_service, BPF_F_NO_PREALLOC) lb6_services SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_LB_BACKENDS_MAX, __u32, struct lb6_backend, BPF_F_NO_PREALLOC) lb6_backends SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, CILIATE_LB_REVNAT_MAX, struct lb6_revnat_key, struct lb6_revnat_value, 0) lb6_revnat SEC(".maps");

static __always_inline int lb6_v4_mapped(const __u32 *a)
{
	return a[0] == 0 && a[1] == 0 && a[2] == bpf_htonl(0xffff);
}

static __always_inline void lb6_copy(__u32 *to, const __u32 *from)
{
	to[0] = from[0];
	to[1] = from[1];
	to[2] = from[2];
	to[3] = from[3];
}

/* lb4_xlate for an IPv6 frontend. */
static __always_inline int lb6_xlate(struct bpf_sock_addr *ctx, __u32 proto, __u32 *address,
				     __u32 *port)
{
	struct lb6_key key = {};
	lb6_copy(key.address, address);
	key.dport = (__u16)*port;
	key.proto = (__u8)proto;
	struct lb4_service *svc = bpf_map_lookup_elem(&lb6_services, &key);
	if (!svc)
		return LB_NONE;
	__u16 count = svc->count;
	__u32 service_id = svc->service_id;
	if (count == 0)
		return LB_REJECT;
	key.backend_slot = (bpf_get_prandom_u32() % count) + 1;
	struct lb4_service *slot = bpf_map_lookup_elem(&lb6_services, &key);
	if (!slot)
		return LB_REJECT;
	struct lb6_backend *be = bpf_map_lookup_elem(&lb6_backends, &slot->backend_id);
	if (!be)
		return LB_REJECT;
	if (proto == IPPROTO_UDP) {
		struct lb6_revnat_key rk = {};
		rk.cookie = bpf_get_socket_cookie(ctx);
		lb6_copy(rk.address, be->address);
		rk.port = be->port;
		struct lb6_revnat_value rv = {};
		lb6_copy(rv.address, address);
		rv.port = (__u16)*port;
		rv.service_id = service_id;
		if (bpf_map_update_elem(&lb6_revnat, &rk, &rv, BPF_ANY) != 0)
			return LB_REJECT;
	}
	lb6_copy(address, be->address);
	*port = be->port;
	return LB_TRANSLATED;
}

/* lb4_unxlate for an IPv6 peer. */
static __always_inline int lb6_unxlate(struct bpf_sock_addr *ctx, __u32 *address, __u32 *port)
{
	struct lb6_revnat_key rk = {};
	rk.cookie = bpf_get_socket_cookie(ctx);
	lb6_copy(rk.address, address);
	rk.port = (__u16)*port;
	struct lb6_revnat_value *rv = bpf_map_lookup_elem(&lb6_revnat, &rk);
	if (!rv)
		return 0;
	lb6_copy(address, rv->address);
	*port = rv->port;
	return 1;
}

static __always_inline void lb6_read(struct bpf_sock_addr *ctx, __u32 *a)
{
	a[0] = ctx->user_ip6[0];
	a[1] = ctx->user_ip6[1];
	a[2] = ctx->user_ip6[2];
	a[3] = ctx->user_ip6[3];
}

static __always_inline void lb6_write(struct bpf_sock_addr *ctx, const __u32 *a, __u32 port)
{
	ctx->user_ip6[0] = a[0];
	ctx->user_ip6[1] = a[1];
	ctx->user_ip6[2] = a[2];
	ctx->user_ip6[3] = a[3];
	ctx->user_port = port;
}

/* lb4_translate for an IPv6 socket's destination. */
static __always_inline int lb6_translate(struct bpf_sock_addr *ctx)
{
	__u32 proto = ctx->protocol;
	if (!lb_proto_translated(proto))
		return SYS_PROCEED;
	__u32 address[4];
	lb6_read(ctx, address);
	__u32 port = ctx->user_port;
	int r = lb6_v4_mapped(address) ? lb4_xlate(ctx, proto, &address[3], &port)
				       : lb6_xlate(ctx, proto, address, &port);
	if (r == LB_REJECT)
		return SYS_REJECT;
	if (r == LB_TRANSLATED)
		lb6_write(ctx, address, port);
	return SYS_PROCEED;
}

/* lb4_reverse for an IPv6 socket's peer. */
static __always_inline void lb6_reverse(struct bpf_sock_addr *ctx)
{
	__u32 address[4];
	lb6_read(ctx, address);
	__u32 port = ctx->user_port;
	int found = lb6_v4_mapped(address) ? lb4_unxlate(ctx, &address[3], &port)
					   : lb6_unxlate(ctx, address, &port);
	if (found)
		lb6_write(ctx, address, port);
}

#endif /* CILIATE_LIB_LB6_H */
