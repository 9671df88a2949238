package ibverbs

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// systemHeader is libibverbs-dev's header, which gbverbs.h must agree with.
const systemHeader = "/usr/include/infiniband/verbs.h"

// abiChecks pairs each structure of gbverbs.h with libibverbs' own and
// names the members whose offsets must agree; sizes must agree too, except
// for the padded structures libibverbs fills (at least as large).
var abiChecks = []struct {
	mine, theirs string
	// size: "==" the same size; ">=" padded (libibverbs fills it); ""
	// only its leading members are declared (libibverbs allocates it).
	size   string
	fields [][2]string // mine, theirs
}{
	{"gbv_gid", "union ibv_gid", "==", nil},
	{"gbv_gid_entry", "ibv_gid_entry", "==", [][2]string{{"gid", "gid"}, {"gid_index", "gid_index"}, {"port_num", "port_num"}, {"gid_type", "gid_type"}, {"ndev_ifindex", "ndev_ifindex"}}},
	{"gbv_device_attr", "ibv_device_attr", ">=", [][2]string{{"fw_ver", "fw_ver"}, {"node_guid", "node_guid"}, {"max_mr_size", "max_mr_size"},
		{"max_qp", "max_qp"}, {"max_qp_wr", "max_qp_wr"}, {"max_sge", "max_sge"}, {"max_cqe", "max_cqe"}, {"max_pkeys", "max_pkeys"}, {"phys_port_cnt", "phys_port_cnt"}}},
	{"gbv_port_attr", "ibv_port_attr", ">=", [][2]string{{"state", "state"}, {"max_mtu", "max_mtu"}, {"active_mtu", "active_mtu"},
		{"gid_tbl_len", "gid_tbl_len"}, {"max_msg_sz", "max_msg_sz"}, {"lid", "lid"}, {"active_width", "active_width"},
		{"active_speed", "active_speed"}, {"phys_state", "phys_state"}, {"link_layer", "link_layer"}, {"port_cap_flags2", "port_cap_flags2"}}},
	{"gbv_context", "ibv_context", "", [][2]string{{"ops", "ops"}, {"ops.poll_cq", "ops.poll_cq"}, {"ops.req_notify_cq", "ops.req_notify_cq"},
		{"ops.post_send", "ops.post_send"}, {"ops.post_recv", "ops.post_recv"}, {"cmd_fd", "cmd_fd"}, {"async_fd", "async_fd"}}},
	{"gbv_context_ops", "ibv_context_ops", "==", nil},
	{"gbv_comp_channel", "ibv_comp_channel", "==", [][2]string{{"fd", "fd"}}},
	{"gbv_cq", "ibv_cq", "", [][2]string{{"context", "context"}, {"cq_context", "cq_context"}}},
	{"gbv_mr", "ibv_mr", "==", [][2]string{{"addr", "addr"}, {"length", "length"}, {"lkey", "lkey"}, {"rkey", "rkey"}}},
	{"gbv_qp", "ibv_qp", "", [][2]string{{"context", "context"}, {"qp_num", "qp_num"}, {"state", "state"}}},
	{"gbv_async_event", "ibv_async_event", "==", [][2]string{{"element.port_num", "element.port_num"}, {"event_type", "event_type"}}},
	{"gbv_sge", "ibv_sge", "==", [][2]string{{"addr", "addr"}, {"length", "length"}, {"lkey", "lkey"}}},
	{"gbv_send_wr", "ibv_send_wr", "==", [][2]string{{"wr_id", "wr_id"}, {"next", "next"}, {"sg_list", "sg_list"}, {"num_sge", "num_sge"},
		{"opcode", "opcode"}, {"send_flags", "send_flags"}, {"imm_data", "imm_data"}, {"wr.rdma.remote_addr", "wr.rdma.remote_addr"}, {"wr.rdma.rkey", "wr.rdma.rkey"}}},
	{"gbv_recv_wr", "ibv_recv_wr", "==", [][2]string{{"wr_id", "wr_id"}, {"sg_list", "sg_list"}, {"num_sge", "num_sge"}}},
	{"gbv_wc", "ibv_wc", "==", [][2]string{{"wr_id", "wr_id"}, {"status", "status"}, {"opcode", "opcode"}, {"vendor_err", "vendor_err"},
		{"byte_len", "byte_len"}, {"imm_data", "imm_data"}, {"qp_num", "qp_num"}, {"wc_flags", "wc_flags"}}},
	{"gbv_qp_cap", "ibv_qp_cap", "==", [][2]string{{"max_send_wr", "max_send_wr"}, {"max_inline_data", "max_inline_data"}}},
	{"gbv_qp_init_attr", "ibv_qp_init_attr", "==", [][2]string{{"send_cq", "send_cq"}, {"recv_cq", "recv_cq"}, {"cap", "cap"}, {"qp_type", "qp_type"}, {"sq_sig_all", "sq_sig_all"}}},
	{"gbv_global_route", "ibv_global_route", "==", [][2]string{{"dgid", "dgid"}, {"sgid_index", "sgid_index"}, {"hop_limit", "hop_limit"}}},
	{"gbv_ah_attr", "ibv_ah_attr", "==", [][2]string{{"grh", "grh"}, {"dlid", "dlid"}, {"is_global", "is_global"}, {"port_num", "port_num"}}},
	{"gbv_qp_attr", "ibv_qp_attr", "==", [][2]string{{"qp_state", "qp_state"}, {"path_mtu", "path_mtu"}, {"rq_psn", "rq_psn"}, {"sq_psn", "sq_psn"},
		{"dest_qp_num", "dest_qp_num"}, {"qp_access_flags", "qp_access_flags"}, {"ah_attr", "ah_attr"}, {"pkey_index", "pkey_index"},
		{"max_rd_atomic", "max_rd_atomic"}, {"max_dest_rd_atomic", "max_dest_rd_atomic"}, {"min_rnr_timer", "min_rnr_timer"},
		{"port_num", "port_num"}, {"timeout", "timeout"}, {"retry_cnt", "retry_cnt"}, {"rnr_retry", "rnr_retry"}}},
}

// The constants gbverbs.h restates.
var abiConstants = [][2]string{
	{"GBV_QPT_RC", "IBV_QPT_RC"}, {"GBV_QPS_RESET", "IBV_QPS_RESET"}, {"GBV_QPS_INIT", "IBV_QPS_INIT"}, {"GBV_QPS_RTR", "IBV_QPS_RTR"},
	{"GBV_QPS_RTS", "IBV_QPS_RTS"}, {"GBV_QPS_SQD", "IBV_QPS_SQD"}, {"GBV_QPS_SQE", "IBV_QPS_SQE"}, {"GBV_QPS_ERR", "IBV_QPS_ERR"}, {"GBV_QP_STATE", "IBV_QP_STATE"}, {"GBV_QP_ACCESS_FLAGS", "IBV_QP_ACCESS_FLAGS"},
	{"GBV_QP_PKEY_INDEX", "IBV_QP_PKEY_INDEX"}, {"GBV_QP_PORT", "IBV_QP_PORT"}, {"GBV_QP_AV", "IBV_QP_AV"},
	{"GBV_QP_PATH_MTU", "IBV_QP_PATH_MTU"}, {"GBV_QP_TIMEOUT", "IBV_QP_TIMEOUT"}, {"GBV_QP_RETRY_CNT", "IBV_QP_RETRY_CNT"},
	{"GBV_QP_RNR_RETRY", "IBV_QP_RNR_RETRY"}, {"GBV_QP_RQ_PSN", "IBV_QP_RQ_PSN"}, {"GBV_QP_MAX_QP_RD_ATOMIC", "IBV_QP_MAX_QP_RD_ATOMIC"},
	{"GBV_QP_MIN_RNR_TIMER", "IBV_QP_MIN_RNR_TIMER"}, {"GBV_QP_SQ_PSN", "IBV_QP_SQ_PSN"},
	{"GBV_QP_MAX_DEST_RD_ATOMIC", "IBV_QP_MAX_DEST_RD_ATOMIC"}, {"GBV_QP_DEST_QPN", "IBV_QP_DEST_QPN"},
	{"GBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_LOCAL_WRITE"}, {"GBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_WRITE"},
	{"GBV_WR_RDMA_WRITE", "IBV_WR_RDMA_WRITE"}, {"GBV_WR_RDMA_WRITE_WITH_IMM", "IBV_WR_RDMA_WRITE_WITH_IMM"},
	{"GBV_WR_SEND_WITH_IMM", "IBV_WR_SEND_WITH_IMM"}, {"GBV_SEND_SIGNALED", "IBV_SEND_SIGNALED"},
	{"GBV_WC_RECV", "IBV_WC_RECV"}, {"GBV_WC_RECV_RDMA_WITH_IMM", "IBV_WC_RECV_RDMA_WITH_IMM"}, {"GBV_WC_WITH_IMM", "IBV_WC_WITH_IMM"},
	{"GBV_EVENT_PORT_ACTIVE", "IBV_EVENT_PORT_ACTIVE"}, {"GBV_EVENT_PORT_ERR", "IBV_EVENT_PORT_ERR"},
	{"OpcodeRecv", "IBV_WC_RECV"}, {"OpcodeRecvWriteImm", "IBV_WC_RECV_RDMA_WITH_IMM"}, {"OpcodeRDMAWrite", "IBV_WC_RDMA_WRITE"},
	{"StatusSuccess", "IBV_WC_SUCCESS"}, {"StatusLocLen", "IBV_WC_LOC_LEN_ERR"}, {"StatusLocQPOp", "IBV_WC_LOC_QP_OP_ERR"},
	{"StatusLocProt", "IBV_WC_LOC_PROT_ERR"}, {"StatusFlush", "IBV_WC_WR_FLUSH_ERR"}, {"StatusRemInvReq", "IBV_WC_REM_INV_REQ_ERR"},
	{"StatusRemAccess", "IBV_WC_REM_ACCESS_ERR"}, {"StatusRemOp", "IBV_WC_REM_OP_ERR"}, {"StatusRetryExc", "IBV_WC_RETRY_EXC_ERR"},
	{"StatusRNRRetry", "IBV_WC_RNR_RETRY_EXC_ERR"}, {"StatusFatal", "IBV_WC_FATAL_ERR"},
	{"EventPortActive", "IBV_EVENT_PORT_ACTIVE"}, {"EventPortErr", "IBV_EVENT_PORT_ERR"},
	{"int(PortActive)", "IBV_PORT_ACTIVE"}, {"int(PortDown)", "IBV_PORT_DOWN"}, {"int(LinkEthernet)", "IBV_LINK_LAYER_ETHERNET"},
	{"int(LinkInfiniBand)", "IBV_LINK_LAYER_INFINIBAND"}, {"int(GIDTypeRoCEv2)", "IBV_GID_TYPE_ROCE_V2"},
	{"int(AccessRemoteWrite)", "IBV_ACCESS_REMOTE_WRITE"},
	{"int(QPReset)", "IBV_QPS_RESET"}, {"int(QPInit)", "IBV_QPS_INIT"}, {"int(QPReadyToReceive)", "IBV_QPS_RTR"},
	{"int(QPReadyToSend)", "IBV_QPS_RTS"}, {"int(QPSendDrain)", "IBV_QPS_SQD"}, {"int(QPSendError)", "IBV_QPS_SQE"},
	{"int(QPError)", "IBV_QPS_ERR"},
}

// goConstants are the Go constants abiConstants names, by expression.
var goConstants = map[string]int{
	"OpcodeRecv": OpcodeRecv, "OpcodeRecvWriteImm": OpcodeRecvWriteImm, "OpcodeRDMAWrite": OpcodeRDMAWrite,
	"StatusSuccess": StatusSuccess, "StatusLocLen": StatusLocLen, "StatusLocQPOp": StatusLocQPOp, "StatusLocProt": StatusLocProt,
	"StatusFlush": StatusFlush, "StatusRemInvReq": StatusRemInvReq, "StatusRemAccess": StatusRemAccess, "StatusRemOp": StatusRemOp,
	"StatusRetryExc": StatusRetryExc, "StatusRNRRetry": StatusRNRRetry, "StatusFatal": StatusFatal,
	"EventPortActive": EventPortActive, "EventPortErr": EventPortErr,
	"int(PortActive)": int(PortActive), "int(PortDown)": int(PortDown), "int(LinkEthernet)": int(LinkEthernet),
	"int(LinkInfiniBand)": int(LinkInfiniBand), "int(GIDTypeRoCEv2)": int(GIDTypeRoCEv2), "int(AccessRemoteWrite)": int(AccessRemoteWrite),
	"int(QPReset)": int(QPReset), "int(QPInit)": int(QPInit), "int(QPReadyToReceive)": int(QPReadyToReceive),
	"int(QPReadyToSend)": int(QPReadyToSend), "int(QPSendDrain)": int(QPSendDrain), "int(QPSendError)": int(QPSendError),
	"int(QPError)": int(QPError),
}

// gbverbs.h (and the Go constants) describe libibverbs' binary interface:
// every size, offset and constant agrees with the system's verbs.h, checked
// by the compiler with static assertions.
func TestABIMatchesSystemHeader(t *testing.T) {
	if _, err := os.Stat(systemHeader); err != nil {
		t.Skipf("needs root: %s is missing (libibverbs-dev; make test as root installs it through ci/deps.sh)", systemHeader)
	}
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("needs gcc")
	}
	var b strings.Builder
	b.WriteString("#include <stddef.h>\n#include <infiniband/verbs.h>\n#include \"gbverbs.h\"\n")
	tag := func(s string) string {
		if strings.HasPrefix(s, "union ") {
			return s
		}
		return "struct " + s
	}
	for _, c := range abiChecks {
		if c.size != "" {
			fmt.Fprintf(&b, "_Static_assert(sizeof(struct %s) %s sizeof(%s), \"size of %s\");\n", c.mine, c.size, tag(c.theirs), c.mine)
		}
		for _, f := range c.fields {
			fmt.Fprintf(&b, "_Static_assert(offsetof(struct %s, %s) == offsetof(%s, %s), \"%s.%s\");\n", c.mine, f[0], tag(c.theirs), f[1], c.mine, f[0])
		}
	}
	for _, k := range abiConstants {
		mine := k[0]
		if v, ok := goConstants[mine]; ok {
			mine = fmt.Sprint(v)
		}
		fmt.Fprintf(&b, "_Static_assert((int)(%s) == (int)(%s), \"%s\");\n", mine, k[1], k[0])
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "abi.c")
	require.NoError(t, os.WriteFile(src, []byte(b.String()), 0o644))
	wd, err := os.Getwd()
	require.NoError(t, err)
	out, err := exec.Command("gcc", "-fsyntax-only", "-Wall", "-I", wd, src).CombinedOutput()
	require.NoError(t, err, "gbverbs.h disagrees with %s:\n%s", systemHeader, out)
}
