// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The peer's identity: the host table first (exact /32 or /128), then the prefix trie. */
#ifndef CILIATE_LIB_IPCACHE_H
#define CILIATE_LIB_IPCACHE_H

static __always_inline __u32 peer_identity(struct packet *p, int egress)
{
	struct ipcache_host_key hk = {};
	hk.family = p->family;
	__builtin_memcpy(hk.addr, egress ? p->daddr : p->saddr, 16);
	struct ipcache_value *hv = bpf_map_lookup_elem(&ipcache_hosts, &hk);
	if (hv)
		return hv->identity;
	struct ipcache_key k = {};
	k.family = p->family;
	k.prefixlen = 32 + (p->family == 4 ? 32 : 128);
	__builtin_memcpy(k.addr, egress ? p->daddr : p->saddr, 16);
	struct ipcache_value *v = bpf_map_lookup_elem(&ipcache, &k);
	if (v)
		return v->identity;
	return p->family == 4 ? CILIATE_ID_WORLD_IPV4 : CILIATE_ID_WORLD_IPV6;
}

#endif /* CILIATE_LIB_IPCACHE_H */
