/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Structures the socket-level service translation (services.bpf.c) shares with user space
 * (src/datapath/bpf/services.rs). Addresses and ports are in network byte order, as the
 * program reads them from struct bpf_sock_addr. Every padding byte is explicit.
 */
#ifndef CILIATE_SERVICES_H
#define CILIATE_SERVICES_H

#include <linux/types.h>

#define CILIATE_LB_SERVICES_MAX 262144
#define CILIATE_LB_BACKENDS_MAX 262144
#define CILIATE_LB_REVNAT_MAX 65536

/* A frontend (ClusterIP, port, protocol). Slot 0 is the service's master entry (its id and
 * its number of ready backends); slots 1..count name one backend each (Cilium's lb4_key). */
struct lb4_key {
	__u32 address;
	__u16 dport;
	__u16 backend_slot;
	__u8 proto;
	__u8 pad[3];
};

struct lb4_service {
	__u32 backend_id; /* slots 1..count */
	__u16 count;      /* slot 0: ready backends; 0 means connections fail at once */
	__u16 pad;
	__u32 service_id; /* every slot */
};

struct lb4_backend {
	__u32 address;
	__u16 port;
	__u8 proto;
	__u8 pad;
};

/* UDP reverse translation by socket: what the socket asked for, by where it was sent. */
struct lb4_revnat_key {
	__u64 cookie;
	__u32 address;
	__u16 port;
	__u16 pad;
};

struct lb4_revnat_value {
	__u32 address;
	__u16 port;
	__u16 pad;
	__u32 service_id;
};

/* The IPv6 frontend (lb6_services' key; its values are struct lb4_service). */
struct lb6_key {
	__u32 address[4];
	__u16 dport;
	__u16 backend_slot;
	__u8 proto;
	__u8 pad[3];
};

struct lb6_backend {
	__u32 address[4];
	__u16 port;
	__u8 proto;
	__u8 pad;
};

struct lb6_revnat_key {
	__u64 cookie;
	__u32 address[4];
	__u16 port;
	__u16 pad;
	__u32 pad2;
};

struct lb6_revnat_value {
	__u32 address[4];
	__u16 port;
	__u16 pad;
	__u32 service_id;
};

/* The next ids to hand out (one entry): ids are never reused, across restarts too. */
struct lb_ids {
	__u32 next_service;
	__u32 next_backend;
};

#endif
