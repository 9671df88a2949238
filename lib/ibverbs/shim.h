/* shim.h: libibverbs loaded with dlopen, and small wrappers around the
 * calls that go through a context's operations table. */
#ifndef GBVERBS_SHIM_H
#define GBVERBS_SHIM_H

#include "gbverbs.h"

/* gbv_load opens the library at path and resolves the functions used; on
 * failure it returns -1 with the reason in err. Loading twice is a no-op. */
int gbv_load(const char *path, char *err, int errlen);
int gbv_has_gid_table(void);

void **gbv_get_device_list(int *n);
void gbv_free_device_list(void **list);
const char *gbv_device_name(void *dev);
void *gbv_open_device(void *dev);
int gbv_close_device(void *ctx);
int gbv_query_device(void *ctx, struct gbv_device_attr *attr);
int gbv_query_port(void *ctx, int port, struct gbv_port_attr *attr);
int gbv_query_gid(void *ctx, int port, int index, struct gbv_gid *gid);
long gbv_query_gid_table(void *ctx, struct gbv_gid_entry *entries, long max);
const char *gbv_wc_status_str(int status);

void *gbv_alloc_pd(void *ctx);
int gbv_dealloc_pd(void *pd);
void *gbv_reg_mr(void *pd, uint64_t addr, uint64_t len, int access);
int gbv_dereg_mr(void *mr);

void *gbv_create_comp_channel(void *ctx);
int gbv_destroy_comp_channel(void *ch);
void *gbv_create_cq(void *ctx, int cqe, uint64_t key, void *channel);
int gbv_destroy_cq(void *cq);
int gbv_get_cq_event(void *ch, void **cq, uint64_t *key);
void gbv_ack_cq_events(void *cq, unsigned int n);
int gbv_req_notify_cq(void *cq);
int gbv_poll_cq(void *cq, int n, struct gbv_wc *wc);

int gbv_get_async_event(void *ctx, struct gbv_async_event *ev);
void gbv_ack_async_event(struct gbv_async_event *ev);

void *gbv_create_qp(void *pd, struct gbv_qp_init_attr *attr);
int gbv_modify_qp(void *qp, struct gbv_qp_attr *attr, int mask);
/* gbv_query_qp_state reads the queue pair's state as the device has it
 * (a device moves a queue pair to ERR on its own) into *state. */
int gbv_query_qp_state(void *qp, int *state);
int gbv_destroy_qp(void *qp);

/* gbv_post_write posts one signaled RDMA WRITE (with immediate data when
 * with_imm) of up to two gather entries; gbv_post_send_imm a zero-length
 * signaled SEND with immediate data; gbv_post_recv a receive without
 * buffers (for immediate data only). */
int gbv_post_write(void *qp, uint64_t wr_id, const struct gbv_sge *sge, int nsge,
                   uint64_t raddr, uint32_t rkey, uint32_t imm, int with_imm);
int gbv_post_send_imm(void *qp, uint64_t wr_id, uint32_t imm);
int gbv_post_recv(void *qp, uint64_t wr_id);

#endif
