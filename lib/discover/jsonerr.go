package discover

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
)

// JSONError says why a document (what: "probe report", "record of rank 3")
// could not be decoded: it is not JSON at all, or it is JSON of the wrong
// shape, naming the field and the shape expected there.
func JSONError(what string, err error) error {
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) {
		return fmt.Errorf("%s is not JSON: %w", what, err)
	}
	if te.Field == "" {
		return fmt.Errorf("%s is a JSON %s, want %s", what, te.Value, shapeWords(te.Type))
	}
	return fmt.Errorf("%s is JSON of the wrong shape: field %q is a JSON %s, want %s", what, te.Field, te.Value, shapeWords(te.Type))
}

// shapeWords names the JSON shape that decodes into t.
func shapeWords(t reflect.Type) string {
	if t == nil {
		return "another shape"
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a non-negative integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	}
	return "a " + t.String()
}
