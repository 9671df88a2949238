//go:build cgo && linux

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "shim.h"

/* The functions lib/ibverbs resolves, by name as libibverbs exports them
 * (dlsym gives the default version, IBVERBS_1.1). */
static struct {
	void *handle;
	void **(*get_device_list)(int *);
	void (*free_device_list)(void **);
	const char *(*get_device_name)(void *);
	void *(*open_device)(void *);
	int (*close_device)(void *);
	int (*query_device)(void *, struct gbv_device_attr *);
	int (*query_port)(void *, uint8_t, struct gbv_port_attr *);
	int (*query_gid)(void *, uint8_t, int, struct gbv_gid *);
	long (*query_gid_table)(void *, struct gbv_gid_entry *, size_t, uint32_t, size_t);
	const char *(*wc_status_str)(int);
	void *(*alloc_pd)(void *);
	int (*dealloc_pd)(void *);
	void *(*reg_mr)(void *, void *, size_t, int);
	int (*dereg_mr)(void *);
	void *(*create_comp_channel)(void *);
	int (*destroy_comp_channel)(void *);
	void *(*create_cq)(void *, int, void *, void *, int);
	int (*destroy_cq)(void *);
	int (*get_cq_event)(void *, void **, void **);
	void (*ack_cq_events)(void *, unsigned int);
	int (*get_async_event)(void *, struct gbv_async_event *);
	void (*ack_async_event)(struct gbv_async_event *);
	void *(*create_qp)(void *, struct gbv_qp_init_attr *);
	int (*modify_qp)(void *, struct gbv_qp_attr *, int);
	int (*query_qp)(void *, struct gbv_qp_attr *, int, struct gbv_qp_init_attr *);
	int (*destroy_qp)(void *);
} L;

int gbv_load(const char *path, char *err, int errlen) {
	if (L.handle)
		return 0;
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		snprintf(err, errlen, "%s", dlerror());
		return -1;
	}
#define SYM(field, name)                                                         \
	do {                                                                         \
		*(void **)&L.field = dlsym(h, name);                                     \
		if (!L.field) {                                                          \
			snprintf(err, errlen, "%s has no %s (libibverbs too old?)", path, name); \
			dlclose(h);                                                          \
			memset(&L, 0, sizeof L);                                             \
			return -1;                                                           \
		}                                                                        \
	} while (0)
	SYM(get_device_list, "ibv_get_device_list");
	SYM(free_device_list, "ibv_free_device_list");
	SYM(get_device_name, "ibv_get_device_name");
	SYM(open_device, "ibv_open_device");
	SYM(close_device, "ibv_close_device");
	SYM(query_device, "ibv_query_device");
	SYM(query_port, "ibv_query_port");
	SYM(query_gid, "ibv_query_gid");
	SYM(wc_status_str, "ibv_wc_status_str");
	SYM(alloc_pd, "ibv_alloc_pd");
	SYM(dealloc_pd, "ibv_dealloc_pd");
	SYM(reg_mr, "ibv_reg_mr");
	SYM(dereg_mr, "ibv_dereg_mr");
	SYM(create_comp_channel, "ibv_create_comp_channel");
	SYM(destroy_comp_channel, "ibv_destroy_comp_channel");
	SYM(create_cq, "ibv_create_cq");
	SYM(destroy_cq, "ibv_destroy_cq");
	SYM(get_cq_event, "ibv_get_cq_event");
	SYM(ack_cq_events, "ibv_ack_cq_events");
	SYM(get_async_event, "ibv_get_async_event");
	SYM(ack_async_event, "ibv_ack_async_event");
	SYM(create_qp, "ibv_create_qp");
	SYM(modify_qp, "ibv_modify_qp");
	SYM(query_qp, "ibv_query_qp");
	SYM(destroy_qp, "ibv_destroy_qp");
#undef SYM
	/* Optional: GID types and interfaces (rdma-core 32 and later). */
	*(void **)&L.query_gid_table = dlsym(h, "_ibv_query_gid_table");
	L.handle = h;
	return 0;
}

int gbv_has_gid_table(void) { return L.query_gid_table != NULL; }

void **gbv_get_device_list(int *n) { return L.get_device_list(n); }
void gbv_free_device_list(void **list) { L.free_device_list(list); }
const char *gbv_device_name(void *dev) { return L.get_device_name(dev); }
void *gbv_open_device(void *dev) { return L.open_device(dev); }
int gbv_close_device(void *ctx) { return L.close_device(ctx); }

int gbv_query_device(void *ctx, struct gbv_device_attr *attr) {
	memset(attr, 0, sizeof *attr);
	return L.query_device(ctx, attr);
}

int gbv_query_port(void *ctx, int port, struct gbv_port_attr *attr) {
	memset(attr, 0, sizeof *attr);
	return L.query_port(ctx, (uint8_t)port, attr);
}

int gbv_query_gid(void *ctx, int port, int index, struct gbv_gid *gid) {
	return L.query_gid(ctx, (uint8_t)port, index, gid);
}

long gbv_query_gid_table(void *ctx, struct gbv_gid_entry *entries, long max) {
	if (!L.query_gid_table) {
		errno = ENOSYS;
		return -1;
	}
	return L.query_gid_table(ctx, entries, (size_t)max, 0, sizeof *entries);
}

const char *gbv_wc_status_str(int status) { return L.wc_status_str(status); }
void *gbv_alloc_pd(void *ctx) { return L.alloc_pd(ctx); }
int gbv_dealloc_pd(void *pd) { return L.dealloc_pd(pd); }
void *gbv_reg_mr(void *pd, uint64_t addr, uint64_t len, int access) {
	return L.reg_mr(pd, (void *)(uintptr_t)addr, (size_t)len, access);
}
int gbv_dereg_mr(void *mr) { return L.dereg_mr(mr); }
void *gbv_create_comp_channel(void *ctx) { return L.create_comp_channel(ctx); }
int gbv_destroy_comp_channel(void *ch) { return L.destroy_comp_channel(ch); }
void *gbv_create_cq(void *ctx, int cqe, uint64_t key, void *channel) {
	/* The key travels as the CQ's context pointer, never dereferenced. */
	return L.create_cq(ctx, cqe, (void *)(uintptr_t)key, channel, 0);
}
int gbv_destroy_cq(void *cq) { return L.destroy_cq(cq); }
int gbv_get_cq_event(void *ch, void **cq, uint64_t *key) {
	void *c = NULL;
	int r = L.get_cq_event(ch, cq, &c);
	*key = (uint64_t)(uintptr_t)c;
	return r;
}
void gbv_ack_cq_events(void *cq, unsigned int n) { L.ack_cq_events(cq, n); }
int gbv_get_async_event(void *ctx, struct gbv_async_event *ev) { return L.get_async_event(ctx, ev); }
void gbv_ack_async_event(struct gbv_async_event *ev) { L.ack_async_event(ev); }
void *gbv_create_qp(void *pd, struct gbv_qp_init_attr *attr) { return L.create_qp(pd, attr); }
int gbv_modify_qp(void *qp, struct gbv_qp_attr *attr, int mask) { return L.modify_qp(qp, attr, mask); }
int gbv_query_qp_state(void *qp, int *state) {
	struct gbv_qp_attr attr;
	struct gbv_qp_init_attr init;
	memset(&attr, 0, sizeof attr);
	memset(&init, 0, sizeof init);
	int r = L.query_qp(qp, &attr, GBV_QP_STATE, &init);
	if (r == 0)
		*state = attr.qp_state;
	return r;
}
int gbv_destroy_qp(void *qp) { return L.destroy_qp(qp); }

/* The data path goes through the context's operations table, as
 * libibverbs' own inline functions do. */
static struct gbv_context_ops *ops_of(void *obj) {
	/* A CQ and a QP both begin with their context. */
	return &((struct gbv_context *)(*(void **)obj))->ops;
}

int gbv_req_notify_cq(void *cq) { return ops_of(cq)->req_notify_cq(cq, 0); }
int gbv_poll_cq(void *cq, int n, struct gbv_wc *wc) { return ops_of(cq)->poll_cq(cq, n, wc); }

int gbv_post_write(void *qp, uint64_t wr_id, const struct gbv_sge *sge, int nsge,
                   uint64_t raddr, uint32_t rkey, uint32_t imm, int with_imm) {
	struct gbv_sge sg[2];
	struct gbv_send_wr wr;
	void *bad = NULL;
	memset(&wr, 0, sizeof wr);
	if (nsge < 0 || nsge > 2)
		return EINVAL;
	memcpy(sg, sge, sizeof sg[0] * (size_t)nsge);
	wr.wr_id = wr_id;
	wr.sg_list = nsge ? sg : NULL;
	wr.num_sge = nsge;
	wr.opcode = with_imm ? GBV_WR_RDMA_WRITE_WITH_IMM : GBV_WR_RDMA_WRITE;
	wr.send_flags = GBV_SEND_SIGNALED;
	wr.imm_data = imm;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ops_of(qp)->post_send(qp, &wr, &bad);
}

int gbv_post_send_imm(void *qp, uint64_t wr_id, uint32_t imm) {
	struct gbv_send_wr wr;
	void *bad = NULL;
	memset(&wr, 0, sizeof wr);
	wr.wr_id = wr_id;
	wr.opcode = GBV_WR_SEND_WITH_IMM;
	wr.send_flags = GBV_SEND_SIGNALED;
	wr.imm_data = imm;
	return ops_of(qp)->post_send(qp, &wr, &bad);
}

int gbv_post_recv(void *qp, uint64_t wr_id) {
	struct gbv_recv_wr wr;
	void *bad = NULL;
	memset(&wr, 0, sizeof wr);
	wr.wr_id = wr_id;
	return ops_of(qp)->post_recv(qp, &wr, &bad);
}
