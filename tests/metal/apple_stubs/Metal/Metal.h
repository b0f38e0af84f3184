// Metal/Metal.h: a stand-in for Apple's header, for the Linux syntax check of csrc/backend/metal/metal_backend.mm
// only (tests/metal/test_apple_host.py). It declares the protocols, classes, selectors and enum values that file
// uses, as the macOS 13+ SDK spells them (values cross-checked against Apple's metal-cpp), and nothing else.
// Nothing here is ever linked: the real backend is built against the system Metal framework on a Mac.
#pragma once
#import <Foundation/Foundation.h>

typedef struct {
  NSUInteger width, height, depth;
} MTLSize;
static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

typedef NS_OPTIONS(NSUInteger, MTLResourceOptions) {
  MTLResourceStorageModeShared = 0 << 4,  // MTLStorageModeShared << MTLResourceStorageModeShift
};
typedef NS_ENUM(NSUInteger, MTLDispatchType) {
  MTLDispatchTypeConcurrent = 1,
};
typedef NS_OPTIONS(NSUInteger, MTLBarrierScope) {
  MTLBarrierScopeBuffers = 1 << 0,
};
typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus) {
  MTLCommandBufferStatusError = 5,
};
typedef NS_OPTIONS(NSUInteger, MTLPipelineOption) {
  MTLPipelineOptionBindingInfo = 1 << 0,
};
typedef NS_ENUM(NSInteger, MTLBindingType) {
  MTLBindingTypeBuffer = 0,
  MTLBindingTypeThreadgroupMemory = 1,
};
typedef NS_ENUM(NSUInteger, MTLBindingAccess) {
  MTLBindingAccessReadOnly = 0,
};
typedef NS_ENUM(NSUInteger, MTLLanguageVersion) {
  MTLLanguageVersion3_0 = (3 << 16) + 0,
};

@protocol MTLResource <NSObject>
@end

@protocol MTLBuffer <MTLResource>
- (void*)contents NS_RETURNS_INNER_POINTER;
@end

@protocol MTLFunction <NSObject>
@end

@protocol MTLLibrary <NSObject>
- (id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@property (readonly) NSArray<NSString*>* functionNames;
@end

@protocol MTLComputePipelineState <NSObject>
@property (readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property (readonly) NSUInteger staticThreadgroupMemoryLength;
@end

@protocol MTLBinding <NSObject>
@property (readonly) MTLBindingType type;
@property (readonly) MTLBindingAccess access;
@property (readonly) NSUInteger index;
@end

@interface MTLComputePipelineReflection : NSObject
@property (readonly) NSArray<id<MTLBinding>>* bindings;
@end
typedef __autoreleasing MTLComputePipelineReflection* MTLAutoreleasedComputePipelineReflection;

@interface MTLCompileOptions : NSObject
@property (readwrite, nonatomic) BOOL fastMathEnabled;
@property (readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end

@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end

@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope;
@end

@protocol MTLCommandBuffer <NSObject>
- (id<MTLComputeCommandEncoder>)computeCommandEncoderWithDispatchType:(MTLDispatchType)dispatchType;
- (void)commit;
- (void)waitUntilCompleted;
@property (readonly) MTLCommandBufferStatus status;
@property (readonly) NSError* error;
@end

@protocol MTLCommandQueue <NSObject>
- (id<MTLCommandBuffer>)commandBuffer;
@end

@protocol MTLDevice <NSObject>
@property (readonly) NSString* name;
@property (readonly) BOOL hasUnifiedMemory;
@property (readonly) NSUInteger maxThreadgroupMemoryLength;
- (id<MTLCommandQueue>)newCommandQueue;
- (id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (id<MTLBuffer>)newBufferWithBytes:(const void*)pointer length:(NSUInteger)length options:(MTLResourceOptions)options;
- (id<MTLBuffer>)newBufferWithBytesNoCopy:(void*)pointer
                                   length:(NSUInteger)length
                                  options:(MTLResourceOptions)options
                              deallocator:(void (^)(void* pointer, NSUInteger length))deallocator;
- (id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(NSError**)error;
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source options:(MTLCompileOptions*)options error:(NSError**)error;
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                           options:(MTLPipelineOption)options
                                                        reflection:(MTLAutoreleasedComputePipelineReflection*)reflection
                                                             error:(NSError**)error;
@end

extern "C" id<MTLDevice> MTLCreateSystemDefaultDevice(void) NS_RETURNS_RETAINED;
