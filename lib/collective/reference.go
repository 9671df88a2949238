package collective

import (
	"fmt"

	"github.com/gpubridge/gpubridge/lib/reduce"
)

// ReferenceAllReduce returns the bytes AllReduce leaves on every member of
// a bridge of members members whose inputs are inputs (one per member, of
// one length), computed one element range at a time in the order the
// package documentation gives:
//
//   - 1 or 2 members: reduce.Reference, ((x0 op x1)), then Finish;
//   - 3 or more: the buffer is cut into members segments of ceil(E/members)
//     elements (E elements in all; the last segments may be shorter or
//     empty), and segment j is reduced in the order x[j+1], x[j+2], ...,
//     x[members-1], x[0], ..., x[j] (member indices mod members), the
//     partial always the earlier operand, then Finish.
//
// It panics on arguments AllReduce would refuse (it is meant for tests and
// selftests).
func ReferenceAllReduce(op reduce.Op, dt reduce.DType, inputs [][]byte, members int) []byte {
	checkRef(op, dt, inputs, members)
	if members <= 2 {
		out, err := reduce.Reference(op, dt, inputs)
		if err != nil {
			panic(err)
		}
		return out
	}
	L := len(inputs[0])
	out := make([]byte, L)
	segOff, segLen := ringSegments(L, dt.Size(), members)
	for j := range members {
		lo, hi := segOff(j), segOff(j)+segLen(j)
		ringOrder(op, dt, out[lo:hi], inputs, j, lo, hi)
	}
	return out
}

// ReferenceReduceScatter returns the out of every member of ReduceScatter
// (result[m] is member m's), for inputs of members × segment bytes each:
// segment m reduced in the order x[0], x[1] for 2 members, and x[m+1],
// x[m+2], ..., x[m] (mod members) for 3 or more, then Finish. It panics on
// arguments ReduceScatter would refuse.
func ReferenceReduceScatter(op reduce.Op, dt reduce.DType, inputs [][]byte, members int) [][]byte {
	checkRef(op, dt, inputs, members)
	L := len(inputs[0]) / members
	if L*members != len(inputs[0]) || L%dt.Size() != 0 {
		panic(fmt.Sprintf("collective: reference reduce_scatter: input of %d bytes is not %d segments of whole %s elements", len(inputs[0]), members, dt))
	}
	res := make([][]byte, members)
	for m := range members {
		res[m] = make([]byte, L)
		if members <= 2 {
			seg := make([][]byte, members)
			for i := range seg {
				seg[i] = inputs[i][m*L : (m+1)*L]
			}
			out, err := reduce.Reference(op, dt, seg)
			if err != nil {
				panic(err)
			}
			res[m] = out
			continue
		}
		ringOrder(op, dt, res[m], inputs, m, m*L, (m+1)*L)
	}
	return res
}

// ringOrder sets dst to inputs[*][lo:hi] reduced in ring order for segment
// j: members j+1, ..., j (mod len(inputs)), then Finish.
func ringOrder(op reduce.Op, dt reduce.DType, dst []byte, inputs [][]byte, j, lo, hi int) {
	n := len(inputs)
	copy(dst, inputs[mod(j+1, n)][lo:hi])
	for k := 2; k <= n; k++ {
		if err := reduce.Combine(op, dt, dst, dst, inputs[mod(j+k, n)][lo:hi]); err != nil {
			panic(err)
		}
	}
	if err := reduce.Finish(op, dt, dst, n); err != nil {
		panic(err)
	}
}

func checkRef(op reduce.Op, dt reduce.DType, inputs [][]byte, members int) {
	if err := reduce.Supported(op, dt); err != nil {
		panic(err)
	}
	if members < 1 || len(inputs) != members {
		panic(fmt.Sprintf("collective: reference: %d inputs for %d members", len(inputs), members))
	}
	for i, in := range inputs {
		if len(in) != len(inputs[0]) || len(in)%dt.Size() != 0 {
			panic(fmt.Sprintf("collective: reference: input %d has %d bytes, input 0 %d, element size %d", i, len(in), len(inputs[0]), dt.Size()))
		}
	}
}
