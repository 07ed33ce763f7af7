#include "coordinator/openai_request_fields.h"

#include "common/utf8.h"
#include "coordinator/json_fields.h"

namespace kvshard::openai_request {

using json_fields::Field;
using json_fields::TypeName;
using nlohmann::json;

void Fail(std::string message, std::string param) {
    throw ValidationError{BadRequest(std::move(message), std::move(param))};
}

namespace {

// Finds where a body that is not JSON goes wrong, without the parser's own words: the byte
// offset, and whether the trouble is a number too large for a double (nlohmann error 406).
class JsonErrorLocator : public nlohmann::json_sax<json> {
  public:
    bool null() override { return true; }
    bool boolean(bool) override { return true; }
    bool number_integer(number_integer_t) override { return true; }
    bool number_unsigned(number_unsigned_t) override { return true; }
    bool number_float(number_float_t, const string_t&) override { return true; }
    bool string(string_t&) override { return true; }
    bool binary(binary_t&) override { return true; }
    bool start_object(std::size_t) override { return true; }
    bool key(string_t&) override { return true; }
    bool end_object() override { return true; }
    bool start_array(std::size_t) override { return true; }
    bool end_array() override { return true; }
    bool parse_error(std::size_t position, const std::string&,
                     const nlohmann::detail::exception& e) override {
        position_ = position;
        number_too_large_ = e.id == 406;
        return false;
    }

    std::size_t position() const { return position_; }
    bool number_too_large() const { return number_too_large_; }

  private:
    std::size_t position_ = 0;
    bool number_too_large_ = false;
};

ApiError NotJson(std::string_view body) {
    JsonErrorLocator locator;
    try {
        json::sax_parse(body, &locator);
    } catch (const json::exception&) {
        // The locator never throws; a parser that does still gets the plain answer below.
    }
    const std::string at = " (at byte " + std::to_string(locator.position()) + ")";
    if (locator.number_too_large()) {
        return BadRequest("the request body holds a number too large for a double" + at, "",
                          "invalid_json");
    }
    return BadRequest("the request body is not valid JSON" + at, "", "invalid_json");
}

void ReadModel(const json& body, const ServedModel& model) {
    const json* v = OptString(body, "model");
    if (v == nullptr) return;  // absent: the one model served
    const std::string& name = v->get_ref<const std::string&>();
    if (!ServesModel(model, name)) throw ValidationError{ModelNotFound(model, name)};
}

}  // namespace

std::optional<int64_t> OptInt(const json& body, const char* name, int64_t min, int64_t max,
                              std::string_view rule) {
    const json* v = Field(body, name);
    if (v == nullptr) return std::nullopt;
    const std::optional<int64_t> integer = json_fields::Integer(*v);
    if (!integer) Fail(std::string("'") + name + "' must be an integer, got " + TypeName(*v), name);
    const int64_t x = *integer;
    if (x < min || x > max) {
        Fail(std::string("'") + name + "' " + std::string(rule) + ", got " + std::to_string(x),
             name);
    }
    return x;
}

std::optional<double> OptNumber(const json& body, const char* name) {
    const json* v = Field(body, name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number())
        Fail(std::string("'") + name + "' must be a number, got " + TypeName(*v), name);
    return v->get<double>();
}

std::optional<bool> OptBool(const json& body, const char* name) {
    const json* v = Field(body, name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean())
        Fail(std::string("'") + name + "' must be a boolean, got " + TypeName(*v), name);
    return v->get<bool>();
}

const json* OptString(const json& body, const char* name) {
    const json* v = Field(body, name);
    if (v != nullptr && !v->is_string()) {
        Fail(std::string("'") + name + "' must be a string, got " + TypeName(*v), name);
    }
    return v;
}

std::optional<ApiError> ReadBody(std::string_view body, const ServedModel& model,
                                 const std::function<void(const json&)>& read) {
    if (!IsValidUtf8(body))
        return BadRequest("the request body is not valid UTF-8", "", "invalid_utf8");
    // nlohmann reads a NUL as the end of the input, so "{...}\0junk" would pass; JSON has no
    // place for a raw NUL (inside strings it must be written \u0000).
    if (const size_t nul = body.find('\0'); nul != std::string_view::npos) {
        return BadRequest("the request body holds a NUL byte (at byte " + std::to_string(nul) +
                              "); JSON text cannot contain one",
                          "", "invalid_json");
    }
    // Every nlohmann exception is caught: a value the checks missed must be a 400 in kvshard's
    // words, never an exception that ends the process or the library's text.
    try {
        bool too_deep = false;
        json j = json_fields::ParseJson(body, &too_deep);
        if (too_deep)
            return BadRequest("the request body nests arrays and objects deeper than " +
                                  std::to_string(json_fields::kMaxJsonDepth) + " levels",
                              "", "invalid_json");
        if (j.is_discarded()) return NotJson(body);
        if (!j.is_object())
            return BadRequest("the request body must be a JSON object, got " + TypeName(j));
        ReadModel(j, model);
        read(j);
    } catch (const ValidationError& e) {
        return e.error;
    } catch (const json::exception&) {
        return BadRequest("the request body could not be read", "", "invalid_json");
    }
    return std::nullopt;
}

}  // namespace kvshard::openai_request
