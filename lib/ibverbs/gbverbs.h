/*
 * gbverbs.h: the part of libibverbs' binary interface (ABI 1.1, stable
 * since 2006; providers are bound to it) that lib/ibverbs uses, declared
 * here so that building gpubridge needs no libibverbs-dev. Only what the
 * library reads or writes is declared; structures that libibverbs fills
 * are padded so that a newer library writing more fields stays inside
 * them. abi_test.go checks every size and offset against the system's
 * <infiniband/verbs.h> when it is installed.
 */
#ifndef GBVERBS_H
#define GBVERBS_H

#include <stddef.h>
#include <stdint.h>

/* Enum values of the ABI. */
enum {
	GBV_QPT_RC = 2,

	GBV_QPS_RESET = 0, GBV_QPS_INIT = 1, GBV_QPS_RTR = 2, GBV_QPS_RTS = 3, GBV_QPS_SQD = 4, GBV_QPS_SQE = 5,
	GBV_QPS_ERR = 6,

	GBV_QP_STATE = 1 << 0, GBV_QP_ACCESS_FLAGS = 1 << 3, GBV_QP_PKEY_INDEX = 1 << 4,
	GBV_QP_PORT = 1 << 5, GBV_QP_AV = 1 << 7, GBV_QP_PATH_MTU = 1 << 8,
	GBV_QP_TIMEOUT = 1 << 9, GBV_QP_RETRY_CNT = 1 << 10, GBV_QP_RNR_RETRY = 1 << 11,
	GBV_QP_RQ_PSN = 1 << 12, GBV_QP_MAX_QP_RD_ATOMIC = 1 << 13, GBV_QP_MIN_RNR_TIMER = 1 << 15,
	GBV_QP_SQ_PSN = 1 << 16, GBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17, GBV_QP_DEST_QPN = 1 << 20,

	GBV_ACCESS_LOCAL_WRITE = 1, GBV_ACCESS_REMOTE_WRITE = 1 << 1,

	GBV_WR_RDMA_WRITE = 0, GBV_WR_RDMA_WRITE_WITH_IMM = 1, GBV_WR_SEND_WITH_IMM = 3,
	GBV_SEND_SIGNALED = 1 << 1,

	GBV_WC_RECV = 1 << 7, GBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1,
	GBV_WC_WITH_IMM = 1 << 1,

	GBV_EVENT_PORT_ACTIVE = 9, GBV_EVENT_PORT_ERR = 10,
};

/* A GID: 16 bytes in network order (libibverbs' union has 64-bit
 * members, hence the alignment). */
struct gbv_gid { uint8_t raw[16]; } __attribute__((aligned(8)));

/* One entry of _ibv_query_gid_table (libibverbs 1.11, rdma-core 32). */
struct gbv_gid_entry {
	struct gbv_gid gid;
	uint32_t gid_index;
	uint32_t port_num;
	uint32_t gid_type; /* 0 IB, 1 RoCE v1, 2 RoCE v2 */
	uint32_t ndev_ifindex;
};

struct gbv_device_attr {
	char fw_ver[64];
	uint64_t node_guid, sys_image_guid, max_mr_size, page_size_cap;
	uint32_t vendor_id, vendor_part_id, hw_ver;
	int max_qp, max_qp_wr;
	unsigned int device_cap_flags;
	int max_sge, max_sge_rd, max_cq, max_cqe, max_mr, max_pd;
	int max_qp_rd_atom, max_ee_rd_atom, max_res_rd_atom, max_qp_init_rd_atom, max_ee_init_rd_atom;
	int atomic_cap;
	int max_ee, max_rdd, max_mw, max_raw_ipv6_qp, max_raw_ethy_qp;
	int max_mcast_grp, max_mcast_qp_attach, max_total_mcast_qp_attach;
	int max_ah, max_fmr, max_map_per_fmr, max_srq, max_srq_wr, max_srq_sge;
	uint16_t max_pkeys;
	uint8_t local_ca_ack_delay, phys_port_cnt;
	uint8_t gb_pad[256];
};

struct gbv_port_attr {
	int state, max_mtu, active_mtu, gid_tbl_len;
	uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
	uint16_t pkey_tbl_len, lid, sm_lid;
	uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply;
	uint8_t active_width, active_speed, phys_state, link_layer, flags;
	uint16_t port_cap_flags2;
	uint8_t gb_pad[256];
};

/* Objects libibverbs allocates: only their leading members are read. */
struct gbv_context_ops {
	void *compat0[11];
	int (*poll_cq)(void *cq, int num_entries, void *wc);
	int (*req_notify_cq)(void *cq, int solicited_only);
	void *compat1[12];
	int (*post_send)(void *qp, void *wr, void **bad_wr);
	int (*post_recv)(void *qp, void *wr, void **bad_wr);
	void *compat2[5];
};

struct gbv_context {
	void *device;
	struct gbv_context_ops ops;
	int cmd_fd, async_fd, num_comp_vectors;
};

struct gbv_comp_channel { void *context; int fd; int refcnt; };
struct gbv_cq { void *context; void *channel; void *cq_context; uint32_t handle; int cqe; };
struct gbv_mr { void *context; void *pd; void *addr; size_t length; uint32_t handle, lkey, rkey; };
struct gbv_qp {
	void *context, *qp_context, *pd, *send_cq, *recv_cq, *srq;
	uint32_t handle, qp_num;
	int state, qp_type;
};

struct gbv_async_event {
	union { void *cq; void *qp; void *srq; void *wq; int port_num; } element;
	int event_type;
};

/* Structures lib/ibverbs fills and passes in. */
struct gbv_sge { uint64_t addr; uint32_t length, lkey; };

struct gbv_send_wr {
	uint64_t wr_id;
	struct gbv_send_wr *next;
	struct gbv_sge *sg_list;
	int num_sge;
	int opcode;
	unsigned int send_flags;
	uint32_t imm_data; /* network order on the wire; opaque here */
	union {
		struct { uint64_t remote_addr; uint32_t rkey; } rdma;
		uint8_t gb_space[32];
	} wr;
	uint32_t qp_type_xrc;
	uint8_t gb_tail[48]; /* bind_mw / tso */
};

struct gbv_recv_wr {
	uint64_t wr_id;
	struct gbv_recv_wr *next;
	struct gbv_sge *sg_list;
	int num_sge;
};

struct gbv_wc {
	uint64_t wr_id;
	int status, opcode;
	uint32_t vendor_err, byte_len, imm_data, qp_num, src_qp;
	unsigned int wc_flags;
	uint16_t pkey_index, slid;
	uint8_t sl, dlid_path_bits;
};

struct gbv_qp_cap { uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data; };

struct gbv_qp_init_attr {
	void *qp_context, *send_cq, *recv_cq, *srq;
	struct gbv_qp_cap cap;
	int qp_type;
	int sq_sig_all;
};

struct gbv_global_route {
	struct gbv_gid dgid;
	uint32_t flow_label;
	uint8_t sgid_index, hop_limit, traffic_class;
};

struct gbv_ah_attr {
	struct gbv_global_route grh;
	uint16_t dlid;
	uint8_t sl, src_path_bits, static_rate, is_global, port_num;
};

struct gbv_qp_attr {
	int qp_state, cur_qp_state, path_mtu, path_mig_state;
	uint32_t qkey, rq_psn, sq_psn, dest_qp_num;
	unsigned int qp_access_flags;
	struct gbv_qp_cap cap;
	struct gbv_ah_attr ah_attr, alt_ah_attr;
	uint16_t pkey_index, alt_pkey_index;
	uint8_t en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic;
	uint8_t min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout;
	uint32_t rate_limit;
};

#endif
