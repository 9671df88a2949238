package bridge

import (
	"context"
	"fmt"
	"os"
	"strconv"

	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// exchangeHosts publishes this member's host under host/<self> and reads
// every member's, in member order (GPUBRIDGE_SIM_HOSTNAME stands in for
// the host name in tests). On failure it says which step failed.
func exchangeHosts(ctx context.Context, kv *store.Client, self, size int) ([]transport.MemberInfo, string, error) {
	host, _ := os.Hostname()
	if h := os.Getenv("GPUBRIDGE_SIM_HOSTNAME"); h != "" {
		host = h
	}
	if err := kv.Set(ctx, "host/"+strconv.Itoa(self), []byte(host)); err != nil {
		return nil, "publish host", err
	}
	members := make([]transport.MemberInfo, size)
	for r := range members {
		b, err := kv.Get(ctx, "host/"+strconv.Itoa(r))
		if err != nil {
			return nil, fmt.Sprintf("waiting for member %d to join", r), err
		}
		members[r] = transport.MemberInfo{Rank: r, Host: string(b)}
	}
	return members, "", nil
}
